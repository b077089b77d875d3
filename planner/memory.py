"""Memory sizes (8GiB, 500MB) and the per-GPU memory model with its pre-flight.

What one rank holds in each phase of an item, as the runtime runs it (every component is
loaded onto every GPU at the start; with `shard_weights` the transformers and the text
encoder are sharded on the CPU first, runtime/weights.py; tensor parallelism splits the
transformers on the CPU, runtime/assembly.py):
  load         every component (or its shard; sharding holds one unit whole at a time), no
               forward yet (`ditango rehearse` reports it; never above text_encode);
  text_encode  the transformer (or its shard), the text encoder (and the blocks FSDP gathers),
               the CLIP image encoder, VAE weights;
  denoise      the same but the text encoder's gathered blocks; the transformer's gathered
               blocks, the DiTango cache and the transient tensors of the largest block
               (activations, ring attention states); unsharded text encoders leave with
               `offload_text_encoder`;
  decode       what stays (an unsharded transformer leaves with `offload_transformer`), VAE
               weights and the decoder's working set (rank 0 alone, or each rank's tiles with
               `vae_parallel`); the DiTango cache is freed before it.
Under tensor parallelism (`tp`) each rank holds 1/n of the blocks' split weights
(`tp_split_params`) and runs the whole token sequence. A phase's peak is what is resident in
it plus its largest transient; the peak is the largest
phase's. The transient terms are derived from the layers diffusers runs (comments below) and
scaled by factors calibrated on CPU against measured peaks (benchmarks/memory.py, its table):
transformer forwards within 4.2% (mean 2.2%) in float32 and bfloat16, VAE decodes within
12.5% (mean 9.5%), weights within 8 MiB. Weights and the DiTango cache are exact counts.
Not modelled: the text encoders' own activations (under 1% of their weights at 512 tokens),
allocator fragmentation and the CUDA context (`HEADROOM_*` keeps room for them). Estimated,
not measured: NCCL's buffers (`NCCL_COMM_BYTES` per communicator). `ditango rehearse` traces
the rest at real shapes (docs/memory.md: its table).

Legend: S tokens (a rank's largest chunk), C transformer width, F FFN width, T text tokens,
e bytes per element of the transformer dtype; B batch (1), H heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from basics.errors import ConfigError
from planner.decode_memory import decode_bytes
from planner.layout import ParallelLayout, chunk_sizes, rank_groups
from planner.models import ModelShape, VideoSize
from planner.precision import block_bytes as quantized_block_bytes
from planner.precision import check_quantize, transformer_bytes

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}  # fmt: skip
GIB = 2**30
F32 = 4
# Measured over derived block bytes on CPU, per dtype (benchmarks/memory.py): bfloat16 forwards
# allocate what the formulas name; float32 ones about a tenth more (copies they do not name).
ACTIVATION_FACTOR = {2: 1.0, 4: 1.1}
# Room the allocator's peak does not show: CUDA context, cuBLAS/NCCL workspaces, fragmentation.
HEADROOM_BYTES = GIB
HEADROOM_FRACTION = 0.05
# Each NCCL communicator a rank holds keeps device buffers for its channels and peers (NCCL's
# NCCL_BUFFSIZE staging, 4 MiB by default, per channel and direction, for each protocol; NVLink
# SHARP adds its own on NVSwitch systems): an estimate per communicator, not traced (a
# rehearsal's process groups have no buffers). runtime/mesh.py makes one per distinct rank set.
NCCL_COMM_BYTES = 512 * 2**20
PHASES = ("text_encode", "denoise", "decode")


MAX_BYTES = 2**50  # 1 PiB: a size beyond this is a typo, and would overflow the arithmetic downstream


def parse_bytes(text: str, flag: str = "size") -> int:
    """'8GiB', '500MB', '1048576' -> bytes; ConfigError naming `flag` for anything else."""
    number = text.strip().upper()
    suffix = number.lstrip("0123456789.")
    value = number[: len(number) - len(suffix)]
    try:
        size = int(float(value) * UNITS[suffix.strip()])
    except (KeyError, ValueError):
        raise ConfigError(f"{flag} {text!r}: expected a size like 80GiB, 500MB, 2TiB or 1048576") from None
    except OverflowError:  # float('1' * 400) is inf
        size = MAX_BYTES + 1
    if size > MAX_BYTES:
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} characters)"
        raise ConfigError(f"{flag} {shown!r}: larger than any machine's memory (at most 1PiB)")
    return size


# -- the DiTango cache (runtime/cache.py allocates exactly this) ----------------------------


def slot_bytes(B: int, S: int, H: int, D: int, element_bytes: int) -> int:
    """One cached state: out [B, S, H, D] of `element_bytes` + lse [B, S, H] float32."""
    return B * S * H * (D * element_bytes + F32)


def unit_bytes(B: int, S: int, H: int, D: int, element_bytes: int, reference: bool = True) -> int:
    """Per cached unit: its state slot plus (`reference`: the hpdc planner) the compressed local
    reference [B, S, H] float32 kept for the drift estimate."""
    return slot_bytes(B, S, H, D, element_bytes) + (B * S * H * F32 if reference else 0)


def anchor_bytes(B: int, S: int, H: int) -> int:
    """Per (branch, layer): the compressed local state [B, S, H] float32 kept at the anchor."""
    return B * S * H * F32


def ditango_cache_bytes(
    shape: ModelShape,
    layout: ParallelLayout,
    tokens: int,
    branches: int,
    element_bytes: int,
    own_group: str = "decide",
    planner: str = "hpdc",
) -> int:
    """The whole cache of the rank with the largest chunk, one unit per remote group (compose
    factor 1: a --cache-memory-limit or the CUDA free-memory limit can compose it smaller),
    one more for the own group's other members (own_group "decide"), and the compressed local
    state kept per (branch, layer): the anchor's (hpdc), the previous step's (budget)."""
    if not layout.strategy.reuses:
        return 0
    S, H, D = max(chunk_sizes(tokens, layout.cp_degree)), shape.heads, shape.head_dim
    units = layout.groups - 1 + int(own_group == "decide" and layout.group > 1)
    per_unit = unit_bytes(1, S, H, D, element_bytes, reference=planner != "budget")
    per_layer = units * per_unit + anchor_bytes(1, S, H)
    return branches * shape.layers * per_layer


# -- options and the estimate ---------------------------------------------------------------


@dataclass(frozen=True)
class MemoryOptions:
    """What decides the bytes besides the model, the video and the layout."""

    dtype_bytes: int = 2  # transformer / text encoder weights and activations (bf16 on CUDA; 4: float32)
    shard_weights: bool = False  # FSDP2 per block + root, transformers and text encoder, over the cp group
    hybrid: bool = False  # Hybridiff (the runtime does not shard with it: no --shard-weights suggested)
    cfg_branches_per_rank: int = 2  # both CFG branches on one rank, in turn; 1: cfg-parallel or guidance <= 1
    cache_bytes: int = 2  # DiTango cache element size
    own_group: str = "decide"  # DiTango's decision units (planner/ditango.py unit_offsets)
    planner: str = "hpdc"  # DiTango's planner: "budget" keeps one more compressed reference
    vae_tiling: bool = False
    vae_parallel: bool = False  # the tiles over the replica's ranks (implies tiling)
    tile_px: int = 256  # the tile's side in output pixels; stride 3/4 of it, as diffusers' enable_tiling
    offload_text_encoder: bool = False  # the (unsharded) text encoders go to the CPU after encoding
    offload_transformer: bool = False  # the (unsharded) transformer goes to the CPU before the decode
    quantize: str = "none"  # "fp8": the blocks' linear weights at one byte and their scales (planner/precision.py)

    def __post_init__(self) -> None:
        check_quantize(self.quantize)
        for name in ("dtype_bytes", "cache_bytes"):
            if getattr(self, name) not in (2, 4):
                raise ConfigError(
                    f"memory model: {name} must be 2 (bfloat16) or 4 (float32), got {getattr(self, name)}"
                )
        if self.cfg_branches_per_rank not in (1, 2):
            raise ConfigError(f"memory model: cfg_branches_per_rank must be 1 or 2, got {self.cfg_branches_per_rank}")
        if self.tile_px < 8:
            raise ConfigError(f"--vae-tile must be >= 8 pixels, got {self.tile_px}")


def communicators(layout: ParallelLayout) -> int:
    """The NCCL communicators rank 0 holds: one per distinct set of two or more ranks among its
    groups (cp, Ulysses, ring, DiTango's near group, CFG partners) and the world, as build_mesh
    makes them (every rank holds as many)."""
    if layout.world_size == 1:
        return 0
    sets = {g for groups in rank_groups(layout).values() for g in groups if 0 in g and len(g) > 1}
    return len(sets | {tuple(range(layout.world_size))})


def cfg_branches(guidance: float, cfg_degree: int) -> int:
    """CFG branches one rank runs per step: 2 with guidance > 1 unless cfg-parallel splits them."""
    return 2 if guidance > 1 and cfg_degree == 1 else 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per GPU (the busiest rank).

    `stages`: each component's own bytes ("weights" the transformer(s), all experts, or this
    rank's shard; "weights_gathered" what FSDP holds unsharded: the root and two blocks;
    "text_encoder" and "text_encoder_gathered" the same for the text encoders; "image_encoder";
    "activations" the largest block's tensors and the forward's full-length inputs,
    "attention_states" ring states and KV blocks in flight, "ditango_cache", "vae_weights",
    "vae_decode" the decoder's working set and outputs, "nccl" the communicators' buffers).
    `phases`: the peak of each phase (not always a sum of components: the attention states
    and the FFN's tensors never coexist), and "load", which never peaks. `peak_stage` is the
    phase that peaks; `peak_component` its largest component.
    """

    stages: dict[str, int]
    phases: dict[str, int]
    peak_bytes: int
    peak_stage: str
    resident: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)  # phase -> component -> bytes

    @property
    def peak_component(self) -> str:
        parts = self.resident.get(self.peak_stage) or {}
        return max(parts, key=lambda k: parts[k]) if parts else ""

    def to_json(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_stage": self.peak_stage,
            "peak_component": self.peak_component,
            "phases": dict(self.phases),
            "stages": dict(self.stages),
        }


def shard_degree(layout: ParallelLayout, options: MemoryOptions) -> int:
    """Ranks `shard_weights` shards over: the cp group, whose ranks run the same blocks at the
    same time under every strategy (each CFG branch's group under cfg-parallel; the runtime
    refuses Hybridiff with sharding, runtime/weights.py)."""
    return layout.cp_degree if options.shard_weights else 1


def weight_parts(shape: ModelShape, layout: ParallelLayout, options: MemoryOptions) -> dict[str, int]:
    """Transformer and text encoder bytes on one rank. Sharded (FSDP2 per block, the rest the
    root unit): the shard; the root's parameters, gathered at the first forward and left
    gathered (FSDP2 does not reshard a root after its forward); and two blocks in flight (the
    one computing, the next prefetched). The float32 pieces the runtime keeps whole (norms,
    modulation tables) are a small share, counted as sharded. Under `quantize` the blocks' linear
    weights count one byte each and their scales four a row (planner/precision.py)."""
    e, n, q = options.dtype_bytes, shard_degree(layout, options), options.quantize
    te, whole = shape.text_encoder_params, shape.text_encoder_whole_params
    block, root = quantized_block_bytes(shape, e, q), shape.root_params * e  # the root is never quantized
    if n == 1:
        split = tp_split_params(shape) if layout.tp > 1 else 0  # tp: each rank keeps 1/n of these (never fp8)
        transformer = transformer_bytes(shape, e, q) - (split - -(-split // layout.tp)) * e
        return {
            "weights": transformer,
            "weights_root": 0,
            "weights_blocks": 0,
            "text_encoder": te * e,
            "text_encoder_root": 0,
            "text_encoder_blocks": 0,
            "offload_text": te * e,
            "offload_transformer": transformer,
        }
    sharded_te = te - whole - shape.text_encoder_root_params
    return {
        "weights": -(-(transformer_bytes(shape, e, q) - root) // n),
        "weights_root": root,
        "weights_blocks": 2 * block,
        "text_encoder": (-(-sharded_te // n) + whole) * e,
        "text_encoder_root": shape.text_encoder_root_params * e,
        "text_encoder_blocks": 2 * shape.text_encoder_block_params * e,
        "offload_text": whole * e,
        "offload_transformer": 0,  # sharded modules stay where FSDP put them
        # FSDP2 all-gathers a unit into one flat buffer and copies it out into the unit's
        # parameters: while a unit is gathered, its bytes are held twice (traced by `ditango
        # rehearse`); the largest unit of each forward, the text encoders' (their root) and
        # the transformer's (a block; its root is gathered once)
        "gather_buffer_text": max(shape.text_encoder_root_params, shape.text_encoder_block_params) * e,
        "gather_buffer": max(block, root),
        # at load each unit lies whole on the GPU while FSDP shards it: the largest one
        "shard_transient": max(block, root, max(shape.text_encoder_block_params, shape.text_encoder_root_params) * e),
    }


def tp_split_params(shape: ModelShape) -> int:
    """Transformer parameters tensor parallelism splits, all experts together: every block's but
    the 11 C it keeps whole (the row-wise projections' biases, norm2's affine, the modulation
    table; runtime/models/wan/ `install_tp`). 0 when the block size is not known."""
    if not shape.block_params:
        return 0
    experts = max(1, round(shape.params / (shape.root_params + shape.layers * shape.block_params)))
    return experts * shape.layers * (shape.block_params - 11 * shape.hidden)


def forward_inputs_bytes(shape: ModelShape, tokens: int, e: int) -> int:
    """The forward's full-length tensors beside a block's own: the patch-embedded input
    [S_full, C] lives through the first block; per-token time projections [S_full, 7C] (a
    narrow view keeps them whole); latents, noise predictions and their float32 copies;
    cross-attention keys and values."""
    C = shape.hidden
    full = tokens * C * e + (tokens * 7 * C * e if shape.per_token_time else 0)
    full += 4 * tokens * shape.out_channels * F32
    if not shape.joint_text:
        full += 2 * (shape.text_len + shape.image_tokens) * C * e
    return full


def block_bytes(shape: ModelShape, layout: ParallelLayout, tokens: int, options: MemoryOptions) -> tuple[int, int, int]:
    """(activations, attention_states, denoise transient) of the largest block's forward on the
    rank with the largest chunk; batch 1 per branch (CFG branches on one rank run in turn)."""
    e, C, F = options.dtype_bytes, shape.hidden, shape.ffn
    # tp: every rank runs the whole sequence (counted at full width: an upper bound, as its
    # q, k, v and FFN tensors are 1/n wide)
    s = layout.strategy.block_tokens(tokens, chunk_sizes(tokens, layout.cp_degree))
    # Rotary temporaries per element of C: diffusers' processor (strategy none, and HunyuanVideo)
    # multiplies by float64/float32 tables (three [S, C/2] float64 at once); ours by float32.
    rot = 12 if layout.strategy.runtime is None or shape.joint_text else 8
    if shape.joint_text:  # HunyuanVideo: the text rows run with the video ones in every block
        s += shape.text_len
        attention = C * (6 * e + rot)  # hidden, normed, q, k, v, rotated copy + temporaries
        # single-stream block: linear1 out [S, 3C + F], GELU [S, F], cat [S, C + F], hidden, normed, out
        others = [(6 * C + 3 * F) * e, 4 * C * e]
    else:
        attention = C * (6 * e + rot)
        # residual update `h.float() + ff.float() * gate`: three float32 [S, C] at once below
        # float32 (two when .float() is a no-op), beside hidden, normed, cross-attn and FFN outputs
        residual = C * (4 * e + (3 if e < F32 else 2) * F32)
        ffn = 3 * C * e + 2 * F * e  # hidden, normed, cross-attention output, up projection, GELU
        others = [residual, ffn]
        if shape.per_token_time:  # the block's float32 [S, 6, C] modulation (+ its .float() copy)
            others.append(C * (e + 6 * F32 * (2 if e < F32 else 1)))
    if layout.ulysses > 1:
        attention += 6 * C * e  # all-to-all send and receive buffers of q, k, v and the output
    states = 0
    if layout.strategy.merges_states(layout):
        # running and partial out fp32 and the merge's result, their lse; two KV blocks [2, S, H, D]
        states = s * (3 * C * F32 + 3 * shape.heads * F32 + 4 * C * e)
    full = forward_inputs_bytes(shape, tokens, e)
    largest, factor = max(attention, *others), ACTIVATION_FACTOR[e]
    activations = round(factor * s * largest) + full
    transient = max(round(factor * s * attention) + states, round(factor * s * max(others)))
    return activations, states, transient + full


def estimate_memory(
    shape: ModelShape,
    layout: ParallelLayout,
    size: VideoSize,
    options: MemoryOptions = MemoryOptions(),
) -> MemoryEstimate:
    """Peak bytes per GPU by phase and component for one item of this size on `layout` (one
    replica's layout)."""
    o = options
    tokens = shape.tokens(size)
    w = weight_parts(shape, layout, o)
    activations, states, transient = block_bytes(shape, layout, tokens, o)
    branches = min(o.cfg_branches_per_rank, 1 if layout.cfg_degree == 2 else 2)
    cache = ditango_cache_bytes(shape, layout, tokens, branches, o.cache_bytes, o.own_group, o.planner)
    vae = shape.vae
    vae_weights = vae.params * F32 if vae else 0
    decode = 0
    if vae is not None:
        ranks = layout.world_size if o.vae_parallel else 1
        decode = decode_bytes(vae, shape.latent_shape(size), o.vae_tiling or o.vae_parallel, o.tile_px, ranks)
    image = shape.image_encoder_params * F32  # CLIP stays on the GPU (the runtime offloads text encoders only)
    stages = {
        "weights": w["weights"],
        "weights_gathered": w["weights_root"] + w["weights_blocks"],
        "text_encoder": w["text_encoder"],
        "text_encoder_gathered": w["text_encoder_root"] + w["text_encoder_blocks"],
        "image_encoder": image,
        "activations": activations,
        "attention_states": states,
        "ditango_cache": cache,
        "vae_weights": vae_weights,
        "vae_decode": decode,
        "nccl": communicators(layout) * NCCL_COMM_BYTES,
    }
    # What stays between phases; the roots stay gathered once they have run (later items).
    text = w["text_encoder"] - (w["offload_text"] if o.offload_text_encoder else 0)
    transformer = w["weights"] - (w["offload_transformer"] if o.offload_transformer else 0)
    base = {
        "image_encoder": image,
        "vae_weights": vae_weights,
        "text_encoder_root": w["text_encoder_root"],
        "nccl": stages["nccl"],
    }
    n = shard_degree(layout, o)
    resident = {
        # what the loader puts on the GPU before anything runs: every module's shard (FSDP2
        # shards the roots too until their first forward gathers them)
        "load": {
            "weights": w["weights"] + -(-w["weights_root"] // n),
            "text_encoder": w["text_encoder"] + -(-w["text_encoder_root"] // n),
            "image_encoder": image,
            "vae_weights": vae_weights,
            "sharding": w.get("shard_transient", 0),
            "nccl": stages["nccl"],
        },
        "text_encode": {
            "weights": w["weights"] + w["weights_root"],
            "text_encoder": w["text_encoder"],
            "text_encoder_blocks": w["text_encoder_blocks"],
            **base,
            "gather_buffer": w.get("gather_buffer_text", 0),
        },
        "denoise": {
            "weights": w["weights"] + w["weights_root"],
            "weights_blocks": w["weights_blocks"],
            "text_encoder": text,
            **base,
            "ditango_cache": cache,
            "block_transient": transient,
            "gather_buffer": w.get("gather_buffer", 0),
        },
        "decode": {
            "weights": transformer + (w["weights_root"] if transformer else 0),
            "text_encoder": text,
            **base,
            "vae_decode": decode,
        },
    }
    phases = {p: sum(resident[p].values()) for p in ("load", *PHASES)}
    peak = max(PHASES, key=lambda p: phases[p])
    return MemoryEstimate(stages, phases, phases[peak], peak, resident)
