"""Section 9 of benchmarks/gpu_check.py: `--quantize fp8` (runtime/quantize.py). `Fp8Linear`
against the bf16 `nn.Linear` it replaces at the widths of Wan2.1-14B's blocks (5120 wide, FFN
13824) and real token counts: relative error, and time per call eager and compiled (the
per-token quantization of the input fuses into the GEMM's neighbours only when compiled, and
`--compile` is on by default on CUDA); then a random-weight Wan transformer of Wan2.1-1.3B's
width (2 blocks) quantized whole (`quantize_transformers`) against its bf16 forward.

float8 GEMMs need compute capability 8.9 or more: below, the section is one line saying so.
On the CPU `torch._scaled_mm` runs too, so the CPU suite runs the error half at small sizes
(its times only printed; tests/test_gpu_check.py).

Shape legend: T tokens, I input features, O output features.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from benchmarks.gpu.compile_checks import errors, median_s
from benchmarks.gpu.model_checks import WAN_SMALL
from benchmarks.gpu.runtime_checks import Row, _rand, random_wan

# (T, I, O): attention projections and the FFN's two layers of Wan2.1-14B at 8k and 32k tokens.
SHAPES = ((8192, 5120, 5120), (8192, 5120, 13824), (32768, 5120, 13824), (32768, 13824, 5120))
# Per-token and per-channel e4m3 (3 mantissa bits) on N(0, 1) data gives ~3.5% relative L2
# on one GEMM; the residual stream carries a block's output past most of it (~1% after two
# random-weight blocks on the CPU).
LINEAR_TOL = 6e-2
MODEL_TOL = 5e-2
MIN_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell


def fp8_skip_reason(device: str) -> str | None:
    """Why this device cannot run float8 GEMMs (None: it can; the CPU can, torch >= 2.7)."""
    if device != "cuda":
        return None
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} < 8.9: no float8 GEMM, fp8 not checked"
    return None


def fp8_rows(
    device: str = "cuda",
    shapes: tuple[tuple[int, int, int], ...] = SHAPES,
    config: dict | None = None,
    latent_shape: tuple[int, int, int] = (21, 30, 52),  # 8,190 tokens
    text_len: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "inductor",
    reps: int = 5,
) -> list[Row]:
    """The linear rows for every shape, then the whole-transformer row; one line below 8.9.
    `backend`: torch.compile's for the compiled timing (the CPU suite: "eager")."""
    if (reason := fp8_skip_reason(device)) is not None:
        return [Row("fp8", f"skipped: {reason}", math.nan, "-", True)]
    rows = []
    for shape in shapes:
        rows += linear_rows(device, shape, dtype, backend, reps)
    return rows + [transformer_row(device, config, latent_shape, text_len, dtype)]


def linear_rows(device: str, shape: tuple[int, int, int], dtype: torch.dtype, backend: str, reps: int) -> list[Row]:
    from runtime.quantize import Fp8Linear

    tokens, fan_in, fan_out = shape  # T, I, O
    g = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    with torch.device(device):
        linear = nn.Linear(fan_in, fan_out, dtype=dtype).requires_grad_(False)
    fp8 = Fp8Linear(linear)
    x_TI = _rand((tokens, fan_in), dtype, device, g)
    with torch.no_grad():
        ref_TO = linear(x_TI)
        got_TO = fp8(x_TI)
    rel, max_abs = errors(got_TO, ref_TO)
    name = f"{tokens} x {fan_in} -> {fan_out}"
    timed = device == "cuda" and backend == "inductor"  # a CPU's float8 GEMM is emulated: its time says nothing
    rows = [
        Row(
            "fp8",
            f"Fp8Linear {name}: vs {str(dtype).removeprefix('torch.')} Linear, relative L2 (max abs {max_abs:.3g})",
            rel,
            f"<= {LINEAR_TOL:g}",
            rel <= LINEAR_TOL and got_TO.dtype == dtype and bool(torch.isfinite(got_TO).all()),
        )
    ]
    with torch.no_grad():
        base_s = median_s(lambda: linear(x_TI), device, reps)
        eager_s = median_s(lambda: fp8(x_TI), device, reps)
        rows.append(
            Row(
                "fp8",
                f"Fp8Linear {name}: time eager {eager_s * 1e3:.2f} ms vs Linear {base_s * 1e3:.2f} ms (ratio)",
                eager_s / base_s,
                "-",
                True,  # eager quantizes the input in separate kernels: a number, not a limit
            )
        )
        if backend:
            torch._dynamo.reset()
            layer = torch.compile(fp8, backend=backend)
            layer(x_TI)  # the compile
            compiled_s = median_s(lambda: layer(x_TI), device, reps)
            ratio = compiled_s / base_s
            rows.append(
                Row(
                    "fp8",
                    f"Fp8Linear {name}: time compiled ({backend}) {compiled_s * 1e3:.2f} ms vs Linear {base_s * 1e3:.2f} ms (ratio)",
                    ratio,
                    "< 1" if timed else "-",
                    ratio < 1 if timed else True,
                )
            )
    return rows


def transformer_row(
    device: str, config: dict | None, latent_shape: tuple[int, int, int], text_len: int, dtype: torch.dtype
) -> Row:
    """A random-weight Wan transformer's forward, its blocks' Linears in fp8 vs in `dtype`."""

    from runtime.quantize import quantize_transformers

    model, forward = random_wan(config or WAN_SMALL, latent_shape, text_len, dtype, device)

    ref = forward()
    done = quantize_transformers([model])
    got = forward()
    rel, max_abs = errors(got, ref)
    tokens = math.prod(n // p for n, p in zip(latent_shape, model.config.patch_size, strict=True))
    report = done.report()
    return Row(
        "fp8",
        f"{config['num_layers']}-block Wan, {tokens} tokens, {report['layers']} layers in fp8 "
        f"({report['skipped_layers']} skipped): forward vs {str(dtype).removeprefix('torch.')}, "
        f"relative L2 (max abs {max_abs:.3g})",
        rel,
        f"<= {MODEL_TOL:g}",
        rel <= MODEL_TOL and report["layers"] > 0 and bool(torch.isfinite(got).all()),
    )
