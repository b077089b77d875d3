"""Topology/hardware cost model: the exact byte counts of planner/traffic.py priced, with
the FLOPs, on a hardware profile. Its assumptions are listed in `ASSUMPTIONS` and printed by
`ditango simulate`. DiTango is priced from a plan its planners make: a recorded plan shape
(planner/plan_shapes.json, or one run's plan file) replayed on the layout and step count
by planner/plan_shape.py.

Notation: P cp ranks with chunk sizes s_j (uneven, planner/layout.py), H heads,
D head dim, e bytes per element of the transformer dtype, B batch (1), F forwards per
rank per step (2 for CFG run in turn, 1 per rank with --cfg-parallel).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from basics.errors import ConfigError
from basics.user_files import read_json_file, user_path
from planner.layout import ParallelLayout, chunk_sizes
from planner.memory import GIB
from planner.models import ModelShape, VideoSize
from planner.precision import attention_efficiency, block_compute_seconds, experts, transformer_bytes
from planner.traffic import Topology, predict_traffic, unit_fractions

# -- hardware -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """Peak numbers per GPU; `ASSUMPTIONS` says how much of each a kernel achieves."""

    name: str
    bf16_tflops: float  # dense bf16 tensor-core peak
    hbm_tbps: float  # HBM bandwidth, TB/s
    intra_gbps: float  # intra-node link bandwidth per GPU per direction, GB/s
    inter_gbps: float  # inter-node (NIC) bandwidth per GPU per direction, GB/s
    latency_us: float  # per message, inter-node (intra-node taken as a third of it)
    source: str = ""
    memory_bytes: int = 0  # per GPU (0: not known); the datasheets' GB are binary-sized HBM stacks
    # Of a hop's transfer and compute, the share of the shorter that hides behind the longer
    # (1: max(compute, transfer), the kernels overlap fully; 0: one after the other).
    overlap: float = 1.0
    # Achieved / peak (ASSUMPTIONS); a profile benchmarks/gpu/profile.py measured is calibrated:
    # its bf16_tflops is the achieved matmul rate, attention its measured share of it.
    matmul_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    # Dense FP8 (e4m3) tensor-core peak, TFLOPS; None: the GPU has none (A100), --quantize fp8 is
    # refused on it (planner/precision.py). Matmuls reach matmul_efficiency of it too.
    fp8_tflops: float | None = None
    # The block's elementwise work compiled (--compile) over eager (planner/precision.py): 1 where
    # not known (a profile file without it), a measured one from benchmarks/gpu/profile.py.
    compile_factor: float = 1.0
    # Attention's achieved / peak under FlashAttention-3 (`--attention flash3`, or auto on it):
    # None where the GPU does not run it (not Hopper) or no figure is known; attention_efficiency
    # prices it there (planner/precision.py `attention_efficiency`).
    flash3_efficiency: float | None = None


# Public datasheet numbers (dense bf16 and fp8: the datasheets' "with sparsity" figures halved,
# e.g. H100 SXM FP8 3,958 -> 1,979). NVLink "900 GB/s" is bidirectional: 450 GB/s per direction.
# NICs: the common 8-GPU server build of each generation, one NIC per GPU (400 Gb/s NDR =
# 50 GB/s; 200 Gb/s HDR = 25 GB/s). Compile factor: COMPILE_FACTOR on every CUDA profile.
COMPILE_FACTOR = 0.8  # conservative: inductor fuses the block's elementwise chains; measured ones are lower
# FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, abstract): on H100 "FP16 reaching up to
# 740 TFLOPs/s (75% utilization)" of the 989 peak, where "FlashAttention-2 achiev[es] only 35%
# utilization"; forward, head dim 128, long sequences. H100 and H200 (same SMs); H20 has no figure.
FLASH3_EFFICIENCY = 0.75
HARDWARE: dict[str, Hardware] = {
    "h20": Hardware("h20", 148.0, 4.0, 450.0, 50.0, 10.0, "NVIDIA H20 datasheet: 148 TFLOPS bf16, 296 fp8 (dense), 4.0 TB/s, NVLink 900 GB/s, 96 GB", 96 * GIB, fp8_tflops=296.0, compile_factor=COMPILE_FACTOR),
    "h100": Hardware("h100", 989.0, 3.35, 450.0, 50.0, 10.0, "NVIDIA H100 SXM datasheet: 989 TFLOPS bf16, 1979 fp8 (dense), 3.35 TB/s, NVLink 900 GB/s, 80 GB", 80 * GIB, fp8_tflops=1979.0, compile_factor=COMPILE_FACTOR, flash3_efficiency=FLASH3_EFFICIENCY),
    "h200": Hardware("h200", 989.0, 4.8, 450.0, 50.0, 10.0, "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16, 1979 fp8 (dense), 4.8 TB/s, NVLink 900 GB/s, 141 GB", 141 * GIB, fp8_tflops=1979.0, compile_factor=COMPILE_FACTOR, flash3_efficiency=FLASH3_EFFICIENCY),
    "a100": Hardware("a100", 312.0, 2.0, 300.0, 25.0, 10.0, "NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS bf16, no fp8, 2.0 TB/s, NVLink 600 GB/s", 80 * GIB, compile_factor=COMPILE_FACTOR),
    "l40s": Hardware("l40s", 362.0, 0.864, 32.0, 25.0, 10.0, "NVIDIA L40S datasheet: 362 TFLOPS bf16, 733 fp8 (dense), 864 GB/s; PCIe Gen4 x16, no NVLink, 48 GB", 48 * GIB, fp8_tflops=733.0, compile_factor=COMPILE_FACTOR),
}  # fmt: skip

ASSUMPTIONS = {
    "matmul_efficiency": 0.7,  # achieved / peak for projections and FFN (1 for a measured profile)
    "attention_efficiency": 0.5,  # achieved / peak for attention (flash-attn class; a measured profile's share)
    "flash3_efficiency": "achieved / peak for attention under FlashAttention-3 (--attention flash3, or auto on a "
    "profile with one): 0.75 on h100 and h200 (arXiv 2407.08608: 740 of 989 TFLOPS, forward); elsewhere "
    "attention_efficiency",
    "link_efficiency": 0.8,  # achieved / nominal bandwidth
    "precision": "planner/precision.py: a block's elementwise work (about 180 passes of C and 2 of F over its "
    "tokens, eager) at 80% of HBM bandwidth, times the profile's compile_factor with --compile; --quantize fp8: "
    "the blocks' linear layers at matmul_efficiency of fp8_tflops, plus a per-token quantization pass over each "
    "one's input (read twice, written once as fp8); attention stays bf16",
    "overlap": "ring/DiTango hops: max(compute, transfer) + (1 - overlap) x min(compute, transfer) + latency (next "
    "block prefetched); the profile's overlap, 1 unless given (--overlap)",
    "block_overhead_us": 150,  # kernel launches and host work per block and forward (not hidden by a graph)
    "kernel_overhead_us": 8,  # host dispatch and launch of one small eager kernel (DiTango's bookkeeping)
    "not_modelled": "text encoder time, scheduler step, stragglers; the VAE decode and launch overheads are priced by "
    "the layout search only (planner/search.py)",
    "memory": "planner/memory.py: peak bytes per GPU by phase (text_encode, denoise, decode); fits: the peak within "
    "the GPU's memory less 5% and 1 GiB; the runtime offloads the encoders / transformer only when short",
    "ulysses": "all-to-all time = bytes over the slowest link class in the group, not overlapped",
    "tp": "each rank computes 1/n of every block's FLOPs (its heads' attention over all tokens, 1/n of the "
    "projections and FFN); per block 3 ring all-reduces of [S, C] and the RMS norms' [S, 1] float32 statistics, "
    "each 2(n-1) steps of 1/n of the tensor over the ring's slowest link plus its latency, on the critical path "
    "(not overlapped); no output gather",
    "ditango_synthetic": "without --plan: the recorded plan shapes (planner/plan_shapes.json, from real runs by "
    "benchmarks/plan_shapes.py) of --planner, replayed: exact = min(steps, warmup + cooldown) (default: as the "
    "recorded runs, generate's defaults for the planner), anchors = max(1, "
    "round(recorded anchor share x non-exact steps)), the rest selective with each unit's recorded computed "
    "fraction, linear between recorded cache ratios (the nearest outside them); the budget planner's selective "
    "total is the planner's own quota (DiTangoPlanner.budget_cells: (1 - cache_ratio) x layers x units cells a "
    "step on average, as the planner schedules them), spread over units as recorded; no anchors where the recording had none; a recording without "
    "an own-group unit lends unit 0 its nearest remote offset's fraction; compose factor 1",
    "plan_mapping": "shapes map onto a layout by relative ring distance: its remote offset d takes the recorded "
    "offset round((d-1)*(n-1)/(G-2)) + 1 of n (nearest to nearest, farthest to farthest), unit 0 (own-group "
    "partner) takes the recorded unit 0; --plan report.json replays that run's plan file the same way (its "
    "planner, cache ratio, unit_offsets); a report without a plan file gives its all-steps computed fraction to "
    "every unit; bytes scale exactly per unit, times take each offset's slowest rank's link",
}


PEAKS = ("bf16_tflops", "hbm_tbps", "intra_gbps", "inter_gbps", "latency_us")


def load_hardware(name_or_file: str) -> Hardware:
    if name_or_file.lower() in HARDWARE:
        return HARDWARE[name_or_file.lower()]
    path = user_path(name_or_file, "--hardware")
    if not path.is_file():
        raise ConfigError(f"--hardware {name_or_file!r}: not one of {', '.join(HARDWARE)} and not a JSON file")
    data = read_json_file(path, "--hardware-file")
    fields = Hardware.__dataclass_fields__
    where = f"--hardware-file {path}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: not a hardware profile (a JSON object with {', '.join(fields)})")
    # "measured": what benchmarks/gpu/profile.py measured besides the peaks (kept for the reader)
    unknown, missing = sorted(set(data) - {*fields, "measured"}), [k for k in PEAKS if k not in data]
    if unknown or missing or "name" not in data:
        what = f"unknown key(s) {', '.join(unknown)}" if unknown else f"missing {', '.join(missing or ['name'])}"
        raise ConfigError(f"{where}: {what}; a profile has {', '.join(fields)}")
    for key in PEAKS:  # each a divisor of the modelled times: positive and finite
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
            raise ConfigError(f"{where}: {key} must be a positive number below 1e9, got {value!r}")
    memory = data.get("memory_bytes", 0)
    if isinstance(memory, bool) or not isinstance(memory, int) or not 0 <= memory <= 2**50:
        raise ConfigError(f"{where}: memory_bytes must be a whole number of bytes (0: not known), got {memory!r}")
    check_overlap(data.get("overlap", 1.0), f"{where}: overlap")
    fp8 = data.get("fp8_tflops")  # absent or null: no FP8 peak known (--quantize fp8 refused)
    if fp8 is not None and (isinstance(fp8, bool) or not isinstance(fp8, int | float) or not 0 < fp8 < 1e9):
        raise ConfigError(f"{where}: fp8_tflops must be a positive number below 1e9 or null, got {fp8!r}")
    factor = data.get("compile_factor", 1.0)
    if not check_overlap(factor, f"{where}: compile_factor"):  # in (0, 1]: compiled never slower
        raise ConfigError(f"{where}: compile_factor must be above 0")
    for key in ("name", "source"):
        if not isinstance(data.get(key, ""), str):
            raise ConfigError(f"{where}: {key} must be a string, got {data[key]!r}")
    measured = data.get("measured") if isinstance(data.get("measured"), dict) else {}
    share = measured.get("best_attention_over_matmul")
    calibrated = {"matmul_efficiency": 1.0, "attention_efficiency": share} if isinstance(share, int | float) else {}
    shares = ("matmul_efficiency", "attention_efficiency", "flash3_efficiency")  # flash3: absent or null, none
    given = {k: data[k] for k in shares if k in data and not (k == "flash3_efficiency" and data[k] is None)}
    for key, value in {**given, **calibrated}.items():
        if not check_overlap(value, f"{where}: {key}"):  # a share in (0, 1]
            raise ConfigError(f"{where}: {key} must be above 0")
    return Hardware(**{**{k: data[k] for k in fields if k in data}, **calibrated})


def check_overlap(value, where: str = "--overlap") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"{where} must be a number in [0, 1], got {value!r}")
    return float(value)


def with_overrides(hw: Hardware, inter_gbps: float | None = None, overlap: float | None = None) -> Hardware:
    """`hw` with `--inter-node-gbps` (per GPU and direction) and `--overlap` where given."""
    if inter_gbps is not None:
        if not 0 < inter_gbps < 1e9:
            raise ConfigError(f"--inter-node-gbps must be a positive number of GB/s, got {inter_gbps}")
        hw = replace(hw, inter_gbps=float(inter_gbps), name=f"{hw.name}, inter-node {inter_gbps:g} GB/s")
    return hw if overlap is None else replace(hw, overlap=check_overlap(overlap))


def report_dict(hw: Hardware) -> dict:
    return {"hardware": asdict(hw), **ASSUMPTIONS}


# -- modelled time ---------------------------------------------------------------------


@dataclass
class Estimate:
    strategy: str
    nodes: int
    gpus_per_node: int
    attention_s: float  # per step, the slowest rank
    step_s: float
    e2e_s: float
    inter_node_bytes: int
    intra_node_bytes: int
    note: str = ""


def bandwidth(hw: Hardware, link: str) -> float:
    gbps = hw.intra_gbps if link == "intra_node" else hw.inter_gbps
    return gbps * 1e9 * ASSUMPTIONS["link_efficiency"]


def latency(hw: Hardware, link: str) -> float:
    return hw.latency_us * 1e-6 / (3 if link == "intra_node" else 1)


def hop_seconds(hw: Hardware, compute: float, transfer: float) -> float:
    return max(compute, transfer) + (1 - hw.overlap) * min(compute, transfer)


def attention_seconds(hw: Hardware, q: int, k: int, heads: int, d: int) -> float:
    return 4.0 * q * k * heads * d / (hw.bf16_tflops * 1e12 * hw.attention_efficiency)


def ring_seconds(
    hw, topo: Topology, ranks, q: int, blocks: list[int], heads: int, d: int, e: int, hops: float = 1.0
) -> float:
    """Slowest member of a ring: own block, then P-1 hops of max(compute, transfer) + latency,
    the hops weighted by `hops` (the share of forwards that make them)."""
    worst = 0.0
    P = len(ranks)
    for me in range(P):
        link = topo.link(ranks[me], ranks[(me - 1) % P])
        total = attention_seconds(hw, q, blocks[me], heads, d)
        for k in range(P - 1):
            s = blocks[(me - k - 1) % P]
            total += hops * (
                hop_seconds(hw, attention_seconds(hw, q, s, heads, d), 2 * s * heads * d * e / bandwidth(hw, link))
                + latency(hw, link)
            )
        worst = max(worst, total)
    return worst


def attention_time(
    hw: Hardware,
    topo: Topology,
    shape: ModelShape,
    tokens: int,
    e: int,
    compute_fraction: float | list[float],
    own_group: str = "decide",
) -> float:
    """One layer's self-attention for one forward on the slowest rank. DiTango computes
    `compute_fraction` of each decision unit (a scalar: of every unit; a list: per unit of
    `traffic.ditango_units(layout, own_group)`)."""
    sizes = chunk_sizes(tokens, topo.layout.cp_degree)
    video = topo.layout.strategy.attention_time(hw, topo, shape, sizes, e, compute_fraction, own_group)
    return video + _joint_text_time(hw, topo, shape, tokens)


def _joint_text_time(hw: Hardware, topo: Topology, shape: ModelShape, tokens: int) -> float:
    """Joint attention's text part (`shape.joint_text`): the local queries over the text keys,
    the text rows over the local chunk and over the text, and the gather of the text rows'
    states (float32) from every cp peer."""
    if not shape.joint_text:
        return 0.0
    H, D, n = shape.heads, shape.head_dim, shape.text_len
    P = topo.layout.cp_degree
    q = max(chunk_sizes(tokens, P))
    t = attention_seconds(hw, q, n, H, D) + attention_seconds(hw, n, q, H, D) + attention_seconds(hw, n, n, H, D)
    if P > 1:
        cp_ranks = topo.groups["cp"][0]
        link = topo.group_link(cp_ranks)
        t += (P - 1) * n * H * (D + 1) * 4 / bandwidth(hw, link) + latency(hw, link)
    return t


def rest_of_block_time(
    hw: Hardware, shape: ModelShape, local_tokens: int, e: int = 2, quantize: str = "none", compile: bool = False
) -> float:
    """Projections, cross-attention, FFN and the elementwise work of one block on one rank's
    tokens (joint-text models: no cross-attention; the text tokens' projections and FFN run on
    every rank), priced under `quantize` and `compile` by planner/precision.py."""
    n, hid, text = local_tokens, shape.hidden, shape.text_len
    rows = {"video": n, "text": text, "joint": n + text, "image": shape.image_tokens, "once": 1}
    if shape.joint_text:
        tokens = n + text
        flops = 2 * tokens * 4 * hid * hid + 2 * tokens * 2 * hid * shape.ffn
        return block_compute_seconds(hw, shape, flops, rows, e, quantize, compile)
    flops = 2 * n * 4 * hid * hid  # self-attention q, k, v, o
    flops += 2 * n * 2 * hid * hid + 2 * text * 2 * shape.text_dim * hid  # cross-attn q, o; k, v of text
    flops += 2 * n * 2 * hid * shape.ffn  # FFN up and down
    rest = block_compute_seconds(hw, shape, flops, rows, e, quantize, compile)
    return rest + attention_seconds(hw, n, text, shape.heads, shape.head_dim)


def estimate(
    hw: Hardware,
    layout: ParallelLayout,
    shape: ModelShape,
    size: VideoSize,
    steps: int,
    *,
    compute_fraction: float | list[float] = 1.0,
    plan_bits=None,
    element_bytes: int = 2,
    own_group: str = "decide",
    plan_kinds: list[str] | None = None,
    planner: str = "hpdc",
    shard_weights: bool = False,
    quantize: str = "none",
    compile: bool = False,
    attention: str = "flash",
) -> Estimate:
    """Time and bytes of one item. DiTango computes `compute_fraction` of each decision unit
    over all steps (see `attention_time`), or exactly `plan_bits`; `plan_kinds` (each step's
    kind) adds the planner's control bytes. `quantize` and `compile` as `--quantize` and
    `--compile` (planner/precision.py): the blocks' matmuls and elementwise work; `attention`
    the kernel's pricing (flash or flash3, planner/precision.py `attention_efficiency`)."""
    hw = replace(hw, attention_efficiency=attention_efficiency(hw, attention))  # every attention priced below
    topo = Topology(layout)
    tokens = shape.tokens(size)
    sizes = chunk_sizes(tokens, layout.cp_degree)
    forwards = 1 if layout.cfg_degree == 2 else shape.guided_forwards
    attn = attention_time(hw, topo, shape, tokens, element_bytes, compute_fraction, own_group)
    strategy = layout.strategy  # a weight-splitting one: 1/tp of every matmul, then its collectives
    local = strategy.block_tokens(tokens, sizes)
    rest = rest_of_block_time(hw, shape, local, element_bytes, quantize, compile) / layout.tp
    rest += strategy.weight_time(hw, topo, shape, tokens, element_bytes)
    gather = 0.0
    if layout.cp_degree > 1 and not strategy.splits_weights:
        cp_ranks = topo.groups["cp"][0]
        link = topo.group_link(cp_ranks)
        gather = (layout.cp_degree - 1) * max(sizes) * shape.out_channels * element_bytes / bandwidth(hw, link)
    step = forwards * (shape.layers * (attn + rest) + gather)
    if shard_weights and layout.cp_degree > 1:  # FSDP gathers every block each forward, prefetched beside compute
        cp_ranks = topo.groups["cp"][0]
        link = topo.group_link(cp_ranks)
        n = layout.cp_degree
        gathered = shape.fsdp_gathered_params * element_bytes  # fp8: less what one expert's quantization saves
        gathered -= (shape.params * element_bytes - transformer_bytes(shape, element_bytes, quantize)) // experts(shape)
        weights = (n - 1) * (gathered // n) / bandwidth(hw, link)
        step = max(step, forwards * weights)
    if layout.cfg_degree == 2:
        pair = topo.groups["cfg"][0]
        link = topo.link(pair[0], pair[1])
        f, h, w = shape.latent_shape(size)
        step += f * h * w * shape.latent_channels * element_bytes / bandwidth(hw, link) + latency(hw, link)
    traffic = predict_traffic(
        layout,
        shape,
        size,
        steps,
        element_bytes=element_bytes,
        plan_bits=plan_bits,
        plan_kinds=plan_kinds,
        own_group=own_group,
        planner=planner,
        shard_weights=shard_weights,
    )
    if strategy.reuses and plan_bits is None:
        fractions = unit_fractions(compute_fraction, layout, own_group)
        for key, n in _fractional_attention_bytes(layout, shape, size, element_bytes, fractions, own_group).items():
            traffic[key] -= round(steps * forwards * shape.layers * n)
    return Estimate(
        layout.strategy.name,
        layout.nodes,
        layout.gpus_per_node,
        forwards * shape.layers * attn,
        step,
        steps * step,
        traffic["inter_node_bytes"],
        traffic["intra_node_bytes"],
    )


def _fractional_attention_bytes(
    layout: ParallelLayout, shape: ModelShape, size: VideoSize, e: int, fractions: list[float], own_group: str
) -> dict:
    """Bytes per (forward, layer) that units computed only `fractions` of the time do not
    move, against computing all: each unit's bytes are those of a one-layer, one-forward
    plan computing only it, less those of a plan computing none (exact counts, weighted)."""
    one = replace(shape, layers=1)
    n = len(fractions)
    if n == 0:
        return {"inter_node_bytes": 0, "intra_node_bytes": 0}

    def one_layer(bits: list[bool]) -> dict:
        return predict_traffic(
            layout, one, size, 1, guidance=False, element_bytes=e, plan_bits=[[bits]], own_group=own_group
        )

    local, full = one_layer([False] * n), one_layer([True] * n)
    only = [one_layer([u == v for u in range(n)]) for v in range(n)]
    saved = {}
    for key in ("inter_node_bytes", "intra_node_bytes"):
        expected = local[key] + sum(f * (o[key] - local[key]) for f, o in zip(fractions, only, strict=True))
        saved[key] = full[key] - expected
    return saved
