"""`--quantize fp8`: the transformer blocks' linear layers in float8.

Shape legend: T tokens (every batch entry's, flattened), I input features, O output features.

A quantized layer (`Fp8Linear`) holds its weight in float8 e4m3 (one byte a weight, stored as
uint8 and read as float8) with one
float32 scale per output channel (the row's largest magnitude maps to e4m3's largest value,
448), and quantizes its input per token on the fly the same way; `torch._scaled_mm` multiplies
the two in float8 and applies both scales and the bias in one call, giving the compute dtype.
The bias stays in the compute dtype.

What is quantized: every `nn.Linear` inside the model's repeated blocks (runtime/compile.py
`repeated_blocks`: attention projections, cross-attention, FFN) whose input and output
widths are multiples of 16 (what float8 GEMMs on GPUs take). Embedders, the output head,
norms and modulation tables stay in the compute dtype: few weights, and the most sensitive.
Quantizing happens once after loading (a single LoRA set fused first; FSDP2 then shards the
float8 weights), on the device or CPU the weights are on.

`keep_original`: a quantized layer also keeps its unquantized Linear, used inside
`Quantized.original()`: what `--reference exact` measures the run against.

float8 GEMMs need a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell); on the
CPU `torch._scaled_mm` runs too, which is what the tests use: torch 2.7 brought it to the CPU
(pytorch#139975), and row-wise scales there take its emulated path, which torch sends them to
on every CPU since pytorch#179118 (2026; tested with torch 2.13). `check_fp8_matmul` tries
one small product before anything is quantized, so a torch without it is refused in one line.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from basics.errors import ConfigError
from runtime.compile import repeated_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ALIGN = 16  # float8 GEMM widths on GPUs come in multiples of 16
TINY = 1e-12  # the smallest scale: an all-zero row or token stays zero
CHUNK = 2**21  # a weight is quantized this many elements at a time: its float32 transients stay small


def quantize_rows(x_TI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8 [T, I], float32 scales [T, 1]) with x ~= x_fp8 * scale, row by row."""
    scale_T1 = x_TI.abs().amax(dim=1, keepdim=True).float().clamp(min=TINY) / FP8_MAX
    scaled = (x_TI.float() / scale_T1).clamp(-FP8_MAX, FP8_MAX)  # rounding may pass 448: e4m3fn has no inf
    return scaled.to(FP8), scale_T1


@functools.cache
def fp8_matmul_problem(device_type: str) -> str | None:
    """Why this torch cannot run a row-wise scaled float8 product on `device_type`, or None."""
    try:
        a, scale = quantize_rows(torch.ones(16, 16, device=device_type))
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.reshape(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return f"--quantize fp8: torch {torch.__version__} has no row-wise float8 matmul on {device_type} ({first})"
    return None


def check_fp8_matmul(device: torch.device) -> None:
    if problem := fp8_matmul_problem(device.type):
        raise ConfigError(problem)


def quantize_weight(w_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a weight, a few rows at a time: the float32 copies it makes while
    loading are CHUNK elements, not the layer's (a 14B model's FFN: 283 MB each)."""
    out_OI = torch.empty(w_OI.shape, dtype=FP8, device=w_OI.device)
    scale_O1 = torch.empty(w_OI.shape[0], 1, dtype=torch.float32, device=w_OI.device)
    step = max(1, CHUNK // w_OI.shape[1])
    for a in range(0, w_OI.shape[0], step):
        out_OI[a : a + step], scale_O1[a : a + step] = quantize_rows(w_OI[a : a + step])
    return out_OI, scale_O1


class Fp8Linear(nn.Module):
    """A Linear whose weight is float8 e4m3 with per-output-channel scales, its input scaled per
    token; the output in the input's dtype."""

    def __init__(self, linear: nn.Linear, keep_original: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_OI, scale_O1 = quantize_weight(linear.weight.detach())
        # Kept as its bytes (uint8) and read as float8: FSDP2 shards and gathers it as any
        # parameter, and gloo (the CPU backend) has no float8 type.
        self.weight = nn.Parameter(weight_OI.view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale", scale_O1.reshape(1, -1).contiguous())  # [1, O]
        self.bias = linear.bias
        self.original = linear if keep_original else None
        self.use_original = False

    @property
    def fp8_weight(self) -> torch.Tensor:
        """The weight [O, I] as float8 e4m3 (a view of its bytes)."""
        return self.weight.view(FP8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_original:
            return self.original(x)
        x_TI = x.reshape(-1, self.in_features)
        x_fp8, scale_T1 = quantize_rows(x_TI)
        # Per-row scales on CUDA give bfloat16 only; other dtypes are cast from it.
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        bias = None if self.bias is None else self.bias.to(out_dtype)
        out_TO = torch._scaled_mm(
            x_fp8, self.fp8_weight.t(), scale_a=scale_T1, scale_b=self.weight_scale, bias=bias, out_dtype=out_dtype
        )
        return out_TO.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantizable(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear and linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


@dataclass
class Quantized:
    """The layers `quantize_transformers` replaced, and what the report says of them."""

    layers: list[Fp8Linear] = field(default_factory=list)
    skipped: int = 0  # block Linears left in the compute dtype (widths not multiples of 16)
    kept: bool = False  # every layer keeps its unquantized original (`original()`)

    def report(self) -> dict:
        weights = sum(layer.weight.numel() for layer in self.layers)
        return {"format": "fp8_e4m3", "layers": len(self.layers), "weights": weights, "skipped_layers": self.skipped}

    @contextlib.contextmanager
    def original(self):
        """Within: the kept unquantized layers run (`keep_original`), for the exact reference."""
        assert self.kept, "quantized without keep_original"
        for layer in self.layers:
            layer.use_original = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer.use_original = False


def quantize_transformers(transformers, keep_original: bool = False, device: torch.device | None = None) -> Quantized:
    """Replace the qualifying Linears of every repeated block of `transformers` in place, each
    moved to `device` first (None: where it is)."""
    check_fp8_matmul(device or next(transformers[0].parameters()).device)
    done = Quantized(kept=keep_original)
    for transformer in transformers:
        for block in repeated_blocks(transformer):
            for module in list(block.modules()):
                for child_name, child in list(module.named_children()):
                    if type(child) is not nn.Linear:
                        continue
                    if not quantizable(child):
                        done.skipped += 1
                        continue
                    layer = Fp8Linear(child if device is None else child.to(device), keep_original)
                    setattr(module, child_name, layer)
                    done.layers.append(layer)
    return done
