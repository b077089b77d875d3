"""How the transformer's numbers are stored and run: `--quantize` (the blocks' linear layers'
weights and matmuls) and `--compile`; the one place that knows what each costs in bytes and in
time (planner/memory.py, planner/host_memory.py and planner/cost_model.py ask it).

`--quantize fp8` (runtime/quantize.py): every nn.Linear inside the transformer's repeated
blocks whose in and out features are multiples of `FP8_ALIGN` holds a float8 e4m3 weight
(1 byte a weight) and a float32 scale per output row; its bias stays in the compute dtype, and
so does everything outside the blocks (embedders, head, norms, modulation tables). Its
activations are quantized per token on the fly: a memory-bound pass over the layer's input
before its matmul, which runs at the GPU's FP8 peak.

`--compile` (runtime/compile.py): the repeated block compiled by inductor, which fuses the
block's elementwise work (norms, modulation, rotary, residuals, casts, the quantization
passes); the profile's `compile_factor` scales that work's time. Matmuls and attention are
library kernels either way.

`--attention` (runtime/kernels.py): attention is priced at the profile's `attention_efficiency`
of the bf16 peak (flash-attn 2 class: flash, sdpa, whose CUDA kernel is FlashAttention-2's, and
reference), or under FlashAttention-3 (flash3; auto on a profile that has one, as auto picks it
on Hopper) at its `flash3_efficiency` where the profile has one: `attention_pricing`.

The blocks' linear layers are read off the model's shape (planner/models.py) as diffusers
builds them: `block_kinds`. Legend: C width, F FFN width.
"""

from __future__ import annotations

from dataclasses import dataclass

from basics.errors import ConfigError
from planner.models import ModelShape

QUANTIZE = ("none", "fp8")
ATTENTION = ("flash", "flash3")  # how attention is priced (`attention_efficiency`)
FP8_BYTES = 1  # float8 e4m3
SCALE_BYTES = 4  # float32, one per output row of a quantized weight
FP8_ALIGN = 16  # torch._scaled_mm: both sides of the weight multiples of 16
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores; Ampere has none
# The eager block's elementwise traffic per token, in passes of the compute dtype over width C
# and F: counted off diffusers' WanTransformerBlock in bfloat16 (three LayerNorms with their
# float32 casts and modulation, the q/k RMS norms of both attentions, rotary on q and k, three
# gated residuals; about 358 C + 4 F bytes a token) and taken for every family's block. An
# estimate, not measured: benchmarks/gpu/profile.py measures the compile factor it is scaled by.
ELEMENTWISE_PASSES_C = 180
ELEMENTWISE_PASSES_F = 2
HBM_EFFICIENCY = 0.8  # achieved / peak HBM bandwidth of a streaming elementwise kernel
# The quantization of one activation: its input read twice (per-token amax, then scale and cast)
# and written once as float8 (the per-token float32 scale is 1/C of it, left out).
QUANT_READS = 2


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of a block: its sides and the rows it runs on per forward ("video": the
    rank's video tokens, "text" the text tokens, "image" the image tokens, "joint" video and
    text together, "once" one row: the timestep's modulation)."""

    fan_in: int
    fan_out: int
    rows: str = "video"

    @property
    def quantized(self) -> bool:
        return self.fan_in % FP8_ALIGN == 0 and self.fan_out % FP8_ALIGN == 0


def _wan_block(C: int, F: int, image: bool) -> tuple[Linear, ...]:
    """diffusers' WanTransformerBlock: attn1 q, k, v, out; attn2 q, out on the video, k, v on the
    (embedded, C wide) text, add_k / add_v on the image tokens (I2V, `added_kv_proj_dim` C in
    Wan2.1-I2V); the FFN up and down."""
    attn1 = (Linear(C, C),) * 4
    attn2 = (Linear(C, C), Linear(C, C, "text"), Linear(C, C, "text"), Linear(C, C))
    added = (Linear(C, C, "image"),) * 2 if image else ()
    return attn1 + attn2 + added + (Linear(C, F), Linear(F, C))


def _dual_block(C: int, F: int) -> tuple[Linear, ...]:
    """diffusers' HunyuanVideoTransformerBlock: per stream a 6C modulation linear, q, k, v, out
    and the MLP."""
    per_stream = []
    for rows in ("video", "text"):
        per_stream += [Linear(C, 6 * C, "once"), *(Linear(C, C, rows),) * 4, Linear(C, F, rows), Linear(F, C, rows)]
    return tuple(per_stream)


def _single_block(C: int, F: int) -> tuple[Linear, ...]:
    """diffusers' HunyuanVideoSingleTransformerBlock over video and text together: a 3C
    modulation linear, q, k, v, the MLP's input and the output over [attention, MLP]."""
    return (Linear(C, 3 * C, "once"), *(Linear(C, C, "joint"),) * 3, Linear(C, F, "joint"), Linear(C + F, C, "joint"))


def _params(linears: tuple[Linear, ...]) -> int:
    return sum(lin.fan_in * lin.fan_out + lin.fan_out for lin in linears)


def experts(shape: ModelShape) -> int:
    """Transformers of the model (Wan2.2 A14B: 2), from its parameters and one's size."""
    one = shape.root_params + shape.layers * shape.block_params
    return max(1, round(shape.params / one)) if shape.block_params and shape.params else 1


def block_kinds(shape: ModelShape) -> list[tuple[int, tuple[Linear, ...]]]:
    """(blocks of this kind in one transformer, one block's linear layers), largest kind first.
    Joint-text models (HunyuanVideo) have dual- and single-stream blocks: how many of each is
    solved from the blocks' parameter total (params per transformer less the root) and the two
    blocks' sizes (each its linears and its q/k norms); where that does not come out whole
    (a shape without its block sizes), every block counts as single-stream, the smaller one:
    fewer weights counted at one byte, so the memory is not under-estimated."""
    C, F, L = shape.hidden, shape.ffn, shape.layers
    if not shape.joint_text:
        return [(L, _wan_block(C, F, shape.image_tokens > 0))]
    dual, single = _dual_block(C, F), _single_block(C, F)
    dual_n, single_n = _params(dual) + 4 * shape.head_dim, _params(single) + 2 * shape.head_dim
    blocks = shape.params // experts(shape) - shape.root_params
    n, rest = divmod(blocks - L * single_n, dual_n - single_n)
    if not shape.block_params or rest or not 0 <= n <= L:
        return [(L, single)]
    return [(n, dual), (L - n, single)]


def quantized_counts(shape: ModelShape, per_block: bool = False) -> tuple[int, int]:
    """(weights, output rows) of the blocks' linear layers fp8 quantizes: all experts together,
    or (`per_block`) those of the largest block."""
    kinds = block_kinds(shape)
    if per_block:
        kinds = [(1, kinds[0][1])]
    weights = rows = 0
    for n, linears in kinds:
        q = [lin for lin in linears if lin.quantized]
        weights += n * sum(lin.fan_in * lin.fan_out for lin in q)
        rows += n * sum(lin.fan_out for lin in q)
    k = 1 if per_block else experts(shape)
    return k * weights, k * rows


def _bytes(params: int, counts: tuple[int, int], element_bytes: int, quantize: str) -> int:
    check_quantize(quantize)
    if quantize == "none":
        return params * element_bytes
    weights, rows = counts
    return (params - weights) * element_bytes + weights * FP8_BYTES + rows * SCALE_BYTES


def transformer_bytes(shape: ModelShape, element_bytes: int, quantize: str = "none") -> int:
    """Bytes of the transformer's weights (all experts) under `quantize`: the quantized
    weights at one byte and their float32 scales, the rest (biases, embedders, head, norms) at
    `element_bytes`."""
    return _bytes(shape.params, quantized_counts(shape), element_bytes, quantize)


def block_bytes(shape: ModelShape, element_bytes: int, quantize: str = "none") -> int:
    """Bytes of the largest block (`shape.block_params`) under `quantize`."""
    return _bytes(shape.block_params, quantized_counts(shape, per_block=True), element_bytes, quantize)


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE:
        raise ConfigError(f"--quantize {quantize!r}: use one of {', '.join(QUANTIZE)}")


def attention_pricing(backend: str, hw) -> str:
    """How a run's `--attention` backend (auto, sdpa, flash, flash3, reference) is priced on `hw`:
    flash3 where it names flash3, or auto on a profile with a `flash3_efficiency`; else flash."""
    if backend == "flash3" or (backend == "auto" and getattr(hw, "flash3_efficiency", None) is not None):
        return "flash3"
    return "flash"


def attention_efficiency(hw, attention: str = "flash") -> float:
    """Attention's achieved / peak bf16 on `hw` (planner/cost_model.py `Hardware`) priced as
    `attention`: flash3 its `flash3_efficiency` where the profile has one, else (and for flash)
    its `attention_efficiency`."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention {attention!r}: priced as one of {', '.join(ATTENTION)}")
    flash3 = getattr(hw, "flash3_efficiency", None)
    return flash3 if attention == "flash3" and flash3 is not None else hw.attention_efficiency


# -- refusals -------------------------------------------------------------------------------


def check_fp8_hardware(hw, quantize: str) -> None:
    """`--quantize fp8` priced or planned on a profile (planner/cost_model.py `Hardware`) whose
    GPU has no FP8 peak (A100, or a profile file without `fp8_tflops`): refused."""
    if quantize == "fp8" and getattr(hw, "fp8_tflops", None) is None:
        raise ConfigError(
            f"--quantize fp8: the {hw.name} profile has no FP8 peak (fp8_tflops; FP8 tensor cores need compute "
            "capability 8.9+: L40S, H20, H100, H200); use --quantize none, or another --hardware"
        )


def check_fp8_device(capability: tuple[int, int], name: str = "this GPU") -> None:
    """`--quantize fp8` on a CUDA device of `capability` ((major, minor), torch.cuda.
    get_device_capability): refused below 8.9, where torch._scaled_mm has no float8 kernel."""
    if tuple(capability) < FP8_MIN_CAPABILITY:
        have, need = ".".join(map(str, capability)), ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ConfigError(
            f"--quantize fp8: {name} has compute capability {have}, FP8 matmuls need {need} or newer "
            "(L40S, H20, H100, H200); use --quantize none"
        )


# -- time -----------------------------------------------------------------------------------


def _average(shape: ModelShape, count) -> float:
    """The mean over one transformer's blocks of `count(linears)`."""
    kinds = block_kinds(shape)
    return sum(n * count(linears) for n, linears in kinds) / max(1, sum(n for n, _ in kinds))


def quantized_share(shape: ModelShape, tokens: dict[str, int]) -> float:
    """Of a block's matmul FLOPs on these rows (`tokens`: rows per kind, see `Linear`), the share
    in quantized layers (1 for every released model: all their sides are multiples of 16)."""

    def flops(linears, only: bool) -> int:
        return sum(tokens.get(lin.rows, 1) * lin.fan_in * lin.fan_out for lin in linears if lin.quantized or not only)

    total = _average(shape, lambda linears: flops(linears, False))
    return _average(shape, lambda linears: flops(linears, True)) / total if total else 0.0


def quantize_pass_seconds(hw, shape: ModelShape, tokens: dict[str, int], element_bytes: int) -> float:
    """One block's (mean) per-token activation quantization: every quantized layer's input
    read `QUANT_READS` times in the compute dtype and written once as float8, at HBM speed."""
    per_byte = QUANT_READS * element_bytes + FP8_BYTES
    moved = _average(
        shape, lambda linears: sum(tokens.get(lin.rows, 1) * lin.fan_in for lin in linears if lin.quantized)
    )
    return moved * per_byte / (hw.hbm_tbps * 1e12 * HBM_EFFICIENCY)


def elementwise_seconds(hw, shape: ModelShape, rows: int, element_bytes: int) -> float:
    """One block's eager elementwise work on `rows` tokens (`ELEMENTWISE_PASSES_*`), at HBM speed."""
    moved = rows * (ELEMENTWISE_PASSES_C * shape.hidden + ELEMENTWISE_PASSES_F * shape.ffn) * element_bytes
    return moved / (hw.hbm_tbps * 1e12 * HBM_EFFICIENCY)


def block_compute_seconds(
    hw, shape: ModelShape, flops: float, tokens: dict[str, int], element_bytes: int, quantize: str, compile: bool
) -> float:
    """One block's matmuls (`flops`, at the matmul efficiency of the bf16 peak, or of the FP8
    peak for the quantized share) and its elementwise work (eager, or compiled: times the
    profile's `compile_factor`), the activations' quantization passes among it."""
    check_quantize(quantize)
    rate = hw.matmul_efficiency * 1e12
    matmul = flops / (hw.bf16_tflops * rate)
    rows = tokens.get("joint", tokens.get("video", 0))
    other = elementwise_seconds(hw, shape, rows, element_bytes)
    if quantize == "fp8":
        check_fp8_hardware(hw, quantize)
        share = quantized_share(shape, tokens)
        matmul = flops * (1 - share) / (hw.bf16_tflops * rate) + flops * share / (hw.fp8_tflops * rate)
        other += quantize_pass_seconds(hw, shape, tokens, element_bytes)
    return matmul + other * (hw.compile_factor if compile else 1.0)
