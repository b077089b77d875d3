"""Topology/hardware cost model: the exact byte counts of planner/traffic.py priced, with
the FLOPs, on a hardware profile. Its assumptions are listed in `ASSUMPTIONS` and printed by
`ditango simulate`.

Notation: P cp ranks with chunk sizes s_j (uneven, planner/layout.py), H heads,
D head dim, e bytes per element of the transformer dtype, B batch (1), F forwards per
rank per step (2 for CFG run in turn, 1 per rank with --cfg-parallel).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from planner.errors import ConfigError
from planner.layout import ParallelLayout, chunk_sizes
from planner.memory import GIB, MemoryOptions, cfg_branches, estimate_memory, fit_to_memory, usable_bytes
from planner.models import ModelShape
from planner.traffic import Topology, predict_traffic

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


# Public datasheet numbers (dense bf16, no sparsity). NVLink "900 GB/s" is bidirectional:
# 450 GB/s per direction. NICs: the common 8-GPU server build of each generation, one NIC
# per GPU (400 Gb/s NDR = 50 GB/s; 200 Gb/s HDR = 25 GB/s).
HARDWARE: dict[str, Hardware] = {
    "h20": Hardware("h20", 148.0, 4.0, 450.0, 50.0, 10.0, "NVIDIA H20 datasheet: 148 TFLOPS bf16, 4.0 TB/s, NVLink 900 GB/s, 96 GB", 96 * GIB),
    "h100": Hardware("h100", 989.0, 3.35, 450.0, 50.0, 10.0, "NVIDIA H100 SXM datasheet: 989 TFLOPS bf16, 3.35 TB/s, NVLink 900 GB/s, 80 GB", 80 * GIB),
    "h200": Hardware("h200", 989.0, 4.8, 450.0, 50.0, 10.0, "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16, 4.8 TB/s, NVLink 900 GB/s, 141 GB", 141 * GIB),
    "a100": Hardware("a100", 312.0, 2.0, 300.0, 25.0, 10.0, "NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS bf16, 2.0 TB/s, NVLink 600 GB/s", 80 * GIB),
    "l40s": Hardware("l40s", 362.0, 0.864, 32.0, 25.0, 10.0, "NVIDIA L40S datasheet: 362 TFLOPS bf16, 864 GB/s; PCIe Gen4 x16, no NVLink, 48 GB", 48 * GIB),
}  # fmt: skip

ASSUMPTIONS = {
    "matmul_efficiency": 0.7,  # achieved / peak for projections and FFN
    "attention_efficiency": 0.5,  # achieved / peak for attention kernels (flash-attn class)
    "link_efficiency": 0.8,  # achieved / nominal bandwidth
    "overlap": "ring/DiTango hops: max(compute, transfer) + latency (next block prefetched)",
    "not_modelled": "text encoder and VAE decode time, scheduler step, kernel launch overheads, stragglers",
    "memory": "planner/memory.py: peak bytes per GPU by phase (text_encode, denoise, decode); fits: the peak within "
    "the GPU's memory less 5% and 1 GiB; the runtime offloads the encoders / transformer only when short",
    "ulysses": "all-to-all time = bytes over the slowest link class in the group, not overlapped",
    "ditango_synthetic": "without a plan: exact warm-up/cool-down, one anchor, then (1 - cache_ratio) of remote cells computed",
    "plan_mapping": "a small run's plan (report.json + its <id>.plan.json) gives a computed fraction per ring "
    "offset over all steps and layers; big offset d takes small unit round((d-1)*(U_small-1)/(G_big-2)); "
    "a report without a plan file falls back to its mean computed fraction for every offset",
}


def load_hardware(name_or_file: str) -> Hardware:
    if name_or_file.lower() in HARDWARE:
        return HARDWARE[name_or_file.lower()]
    path = Path(name_or_file)
    if not path.is_file():
        raise ConfigError(f"--hardware {name_or_file!r}: not one of {', '.join(HARDWARE)} and not a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Hardware(**{k: data[k] for k in Hardware.__dataclass_fields__ if k in data})
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise ConfigError(f"--hardware-file {path}: not a hardware profile ({exc})") from None


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


def _bw(hw: Hardware, link: str) -> float:
    gbps = hw.intra_gbps if link == "intra_node" else hw.inter_gbps
    return gbps * 1e9 * ASSUMPTIONS["link_efficiency"]


def _lat(hw: Hardware, link: str) -> float:
    return hw.latency_us * 1e-6 / (3 if link == "intra_node" else 1)


def _attn_s(hw: Hardware, q: int, k: int, heads: int, d: int) -> float:
    return 4.0 * q * k * heads * d / (hw.bf16_tflops * 1e12 * ASSUMPTIONS["attention_efficiency"])


def _ring_time(hw, topo: Topology, ranks, q: int, blocks: list[int], heads: int, d: int, e: int) -> float:
    """Slowest member of a ring: own block, then P-1 hops of max(compute, transfer) + latency."""
    worst = 0.0
    P = len(ranks)
    for me in range(P):
        link = topo.link(ranks[me], ranks[(me - 1) % P])
        total = _attn_s(hw, q, blocks[me], heads, d)
        for k in range(P - 1):
            s = blocks[(me - k - 1) % P]
            total += max(_attn_s(hw, q, s, heads, d), 2 * s * heads * d * e / _bw(hw, link)) + _lat(hw, link)
        worst = max(worst, total)
    return worst


def attention_time(
    hw: Hardware, topo: Topology, shape: ModelShape, tokens: int, e: int, compute_fraction: float
) -> float:
    """One layer's self-attention for one forward on the slowest rank."""
    return _video_attention_time(hw, topo, shape, tokens, e, compute_fraction) + _joint_text_time(
        hw, topo, shape, tokens
    )


def _joint_text_time(hw: Hardware, topo: Topology, shape: ModelShape, tokens: int) -> float:
    """Joint attention's text part (`shape.joint_text`): the local queries over the text keys,
    the text rows over the local chunk and over the text, and the gather of the text rows'
    states (float32) from every cp peer."""
    if not shape.joint_text:
        return 0.0
    H, D, n = shape.heads, shape.head_dim, shape.text_len
    P = topo.layout.cp_degree
    q = max(chunk_sizes(tokens, P))
    t = _attn_s(hw, q, n, H, D) + _attn_s(hw, n, q, H, D) + _attn_s(hw, n, n, H, D)
    if P > 1:
        cp_ranks = topo.groups["cp"][0]
        link = "inter_node" if len({topo.node_of[r] for r in cp_ranks}) > 1 else "intra_node"
        t += (P - 1) * n * H * (D + 1) * 4 / _bw(hw, link) + _lat(hw, link)
    return t


def _video_attention_time(
    hw: Hardware, topo: Topology, shape: ModelShape, tokens: int, e: int, compute_fraction: float
) -> float:
    layout = topo.layout
    H, D = shape.heads, shape.head_dim
    sizes = chunk_sizes(tokens, layout.cp_degree)
    cp_ranks = topo.groups["cp"][0]
    q = max(sizes)
    if layout.strategy == "none":
        return _attn_s(hw, tokens, tokens, H, D)
    if layout.strategy in ("ring", "ulysses", "usp"):
        u, h = layout.ulysses, H // layout.ulysses
        t = 0.0
        if u > 1:
            uly = topo.groups["ulysses"][0]
            link = "inter_node" if len({topo.node_of[r] for r in uly}) > 1 else "intra_node"
            a2a = (3 + 1) * q * h * D * e * (u - 1)
            t += a2a / _bw(hw, link) + 2 * (u - 1) * _lat(hw, link)
        spans = [sum(sizes[i * u : (i + 1) * u]) for i in range(layout.ring)]
        ring = topo.groups["ring"][0]
        return t + _ring_time(hw, topo, ring, max(spans), spans, h, D, e)
    # ditango: own group ring always; remote group at offset d computed with probability f_d
    fractions = offset_fractions(compute_fraction, layout.groups)
    size, G = layout.group, layout.groups
    own = _ring_time(hw, topo, cp_ranks[:size], q, sizes[:size], H, D, e)
    remote = 0.0
    for d in range(1, G):
        src = cp_ranks[(size * d) % layout.cp_degree]
        link = topo.link(cp_ranks[0], src)
        fetch = 2 * q * H * D * e / _bw(hw, link) + _lat(hw, link)
        group = _ring_time(hw, topo, cp_ranks[:size], q, sizes[:size], H, D, e)
        computed = max(fetch, group)
        reused = 0.0  # merged from the cache
        remote += fractions[d - 1] * computed + (1 - fractions[d - 1]) * reused
    return own + remote


def rest_of_block_time(hw: Hardware, shape: ModelShape, local_tokens: int) -> float:
    """Projections, cross-attention and FFN of one block on one rank's tokens (joint-text
    models: no cross-attention; the text tokens' projections and FFN run on every rank)."""
    n, hid = local_tokens, shape.hidden
    if shape.joint_text:
        tokens = n + shape.text_len
        flops = 2 * tokens * 4 * hid * hid + 2 * tokens * 2 * hid * shape.ffn
        return flops / (hw.bf16_tflops * 1e12 * ASSUMPTIONS["matmul_efficiency"])
    flops = 2 * n * 4 * hid * hid  # self-attention q, k, v, o
    flops += 2 * n * 2 * hid * hid + 2 * shape.text_len * 2 * shape.text_dim * hid  # cross-attn q, o; k, v of text
    flops += 2 * n * 2 * hid * shape.ffn  # FFN up and down
    matmul = flops / (hw.bf16_tflops * 1e12 * ASSUMPTIONS["matmul_efficiency"])
    return matmul + _attn_s(hw, n, shape.text_len, shape.heads, shape.head_dim)


def estimate(
    hw: Hardware,
    layout: ParallelLayout,
    shape: ModelShape,
    height: int,
    width: int,
    frames: int,
    steps: int,
    *,
    compute_fraction: float = 1.0,
    plan_bits=None,
    element_bytes: int = 2,
) -> Estimate:
    topo = Topology(layout)
    tokens = shape.tokens(height, width, frames)
    sizes = chunk_sizes(tokens, layout.cp_degree)
    forwards = 1 if layout.cfg_degree == 2 else 2
    attn = attention_time(hw, topo, shape, tokens, element_bytes, compute_fraction)
    rest = rest_of_block_time(hw, shape, max(sizes))
    gather = 0.0
    if layout.cp_degree > 1:
        cp_ranks = topo.groups["cp"][0]
        link = "inter_node" if len({topo.node_of[r] for r in cp_ranks}) > 1 else "intra_node"
        gather = (layout.cp_degree - 1) * max(sizes) * shape.out_channels * element_bytes / _bw(hw, link)
    step = forwards * (shape.layers * (attn + rest) + gather)
    if layout.cfg_degree == 2:
        pair = topo.groups["cfg"][0]
        link = topo.link(pair[0], pair[1])
        f, h, w = shape.latent_shape(height, width, frames)
        step += f * h * w * shape.latent_channels * element_bytes / _bw(hw, link) + _lat(hw, link)
    traffic = predict_traffic(
        layout, shape, height, width, frames, steps, element_bytes=element_bytes, plan_bits=plan_bits
    )
    if layout.strategy == "ditango" and plan_bits is None and layout.groups > 1:
        # Synthetic or mapped plan: each offset's remote bytes scale with its computed fraction.
        # Per (forward, layer) from a one-layer, one-forward count, then scaled; the rest of the
        # traffic (gather, cfg) is what the all-computed count already holds.
        fractions = offset_fractions(compute_fraction, layout.groups)
        one = replace(shape, layers=1)
        units = layout.groups - 1

        def one_layer(bits) -> dict:
            return predict_traffic(layout, one, height, width, frames, 1, guidance=False,
                                   element_bytes=element_bytes, plan_bits=[[bits]])  # fmt: skip

        local, full = one_layer([False] * units), one_layer([True] * units)
        only = [one_layer([u == d for u in range(units)]) for d in range(units)]
        cells = steps * forwards * shape.layers
        for key in ("inter_node_bytes", "intra_node_bytes"):
            expected = local[key] + sum(f * (o[key] - local[key]) for f, o in zip(fractions, only, strict=True))
            traffic[key] = round(traffic[key] - cells * (full[key] - expected))
    return Estimate(
        layout.strategy, layout.nodes, layout.gpus_per_node, forwards * shape.layers * attn, step, steps * step,
        traffic["inter_node_bytes"], traffic["intra_node_bytes"],
    )  # fmt: skip


def offset_fractions(compute_fraction: float | list[float], groups: int) -> list[float]:
    """Computed fraction per remote offset 1..groups-1 (a scalar applies to all)."""
    if isinstance(compute_fraction, (int, float)):
        return [float(compute_fraction)] * max(0, groups - 1)
    assert len(compute_fraction) == groups - 1
    return list(compute_fraction)


def map_plan_offsets(plan_log: dict, groups: int) -> list[float]:
    """A small run's plan onto a layout with `groups` groups, by relative ring distance.

    The small run's unit u (offset u+1 of its G_small - 1) has computed fraction f_u over
    all its steps and layers; the big layout's offset d takes f at u = round((d - 1) *
    (U_small - 1) / (G_big - 2)): nearest offsets map to nearest, farthest to farthest."""
    rows = [row for step in plan_log["steps"] for row in step["compute"]]
    units = len(rows[0]) if rows else 0
    if units == 0 or groups < 2:
        return [1.0] * max(0, groups - 1)
    small = [sum(row[u] == "1" for row in rows) / len(rows) for u in range(units)]
    span = max(1, groups - 2)
    return [small[round((d - 1) * (units - 1) / span)] for d in range(1, groups)]


def synthetic_plan_fraction(cache_ratio: float, steps: int, warmup: int = 5, cooldown: int = 5) -> float:
    """Share of remote cells computed over a run: exact warm-up/cool-down and one anchor,
    then (1 - cache_ratio) on the remaining steps (see ASSUMPTIONS)."""
    exact = min(steps, warmup + cooldown + 1)
    return (exact + (steps - exact) * (1.0 - cache_ratio)) / steps


def plan_fraction_from_report(report: dict) -> float:
    """Mean share of remote cells computed per step, from a DiTango report.json item."""
    for item in report.get("items", []):
        per_step = (item.get("attention") or {}).get("per_step")
        if per_step:
            return sum(per_step) / len(per_step)
    raise ConfigError("--plan: the report has no DiTango item (attention.per_step); run with --parallel ditango")


def read_plan(path: Path) -> tuple[float, dict | None]:
    """A DiTango run's report.json -> (mean computed fraction, its first plan file or None)."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        fraction = plan_fraction_from_report(report)
        plan_files = [(i.get("attention") or {}).get("plan_file") for i in report.get("items", [])]
        plan_file = next((path.parent / f for f in plan_files if f), None)
        if plan_file is None or not plan_file.is_file():
            return fraction, None
        return fraction, json.loads(plan_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"--plan {path}: cannot read ({exc})") from None


def plan_fraction(plan: Path | None, cache_ratio: float, steps: int) -> tuple[float, dict | None]:
    """DiTango's computed fraction (and plan file) from `--plan`, or the synthetic one."""
    if plan is not None:
        return read_plan(plan)
    return synthetic_plan_fraction(cache_ratio, steps), None


def simulate_assumptions(hw: Hardware, model: str, tokens: int, steps: int, fraction: float, plan: Path | None,
                         plan_log: dict | None, cache_ratio: float, notes: list[str]) -> dict:  # fmt: skip
    """The `assumptions` of `ditango simulate --json`: the profile, ASSUMPTIONS and the run's inputs."""
    if plan is None:
        source = f"synthetic, cache ratio {cache_ratio:g}"
    else:
        source = f"{plan} (per ring offset from its plan file)" if plan_log is not None else str(plan)
    return {**report_dict(hw), "model": model, "tokens": tokens, "steps": steps,
            "ditango_computed_fraction": round(fraction, 4), "ditango_plan": source, "skipped": notes}  # fmt: skip


def memory_options(shard_weights: bool, cfg_scale: float, vae_tiling: bool, cache_dtype: str) -> MemoryOptions:
    """simulate's memory options: bf16 weights, CFG branches in turn on each rank (no cfg-parallel)."""
    return MemoryOptions(shard_weights=shard_weights, cfg_branches_per_rank=cfg_branches(cfg_scale, 1),
                         vae_tiling=vae_tiling, cache_bytes=4 if cache_dtype == "float32" else 2)  # fmt: skip


def memory_row(shape: ModelShape, layout: ParallelLayout, height: int, width: int, frames: int,
               options: MemoryOptions, vae_parallel: bool | None, gpu_memory_bytes: int | None) -> dict:  # fmt: skip
    """`simulate`'s memory columns for one layout (planner/memory.py), with the offloads the
    runtime turns on when memory is short; `vae_parallel` None: on with more than one rank."""
    o = replace(options, vae_parallel=layout.world_size > 1 if vae_parallel is None else vae_parallel)
    if gpu_memory_bytes:
        o = fit_to_memory(shape, layout, height, width, frames, o, gpu_memory_bytes)
    est = estimate_memory(shape, layout, height, width, frames, o)
    return {"peak_memory_bytes": est.peak_bytes, "peak_memory_stage": est.peak_stage,
            "weights_bytes": est.stages["weights"],
            "offload": [n for n, on in (("encoders", o.offload_text_encoder), ("transformer", o.offload_transformer)) if on],
            "fits": est.peak_bytes <= usable_bytes(gpu_memory_bytes) if gpu_memory_bytes else None}  # fmt: skip


def compare_layouts(
    hw: Hardware, shape: ModelShape, nodes: int, gpus_per_node: int, strategies: list[str], group_size: str,
    height: int, width: int, frames: int, steps: int, fraction: float, plan_log: dict | None = None,
    memory: MemoryOptions = MemoryOptions(), vae_parallel: bool | None = None, gpu_memory_bytes: int | None = None,
) -> tuple[list[dict], list[str]]:  # fmt: skip
    """`ditango simulate`'s rows: every strategy on 1..`nodes` nodes, with the speedup over the
    best exact one and the predicted peak memory per GPU; and a note per illegal layout.
    DiTango computes `fraction` of remote attention, or per ring offset as `plan_log` (a plan
    file) says. `gpu_memory_bytes` (default: the profile's) decides `fits`."""
    for s in strategies:
        if s not in ("ring", "ulysses", "usp", "ditango"):
            raise ConfigError(f"--parallel {s!r}: simulate knows ring, ulysses, usp, ditango")
    gpu_memory_bytes = gpu_memory_bytes or hw.memory_bytes or None
    rows, notes = [], []
    for n in range(1, nodes + 1):
        found = []
        for s in strategies:
            try:
                group = None
                if s == "ditango":
                    group = gpus_per_node if group_size == "node" else int(group_size)
                layout = ParallelLayout(n, gpus_per_node, 1, s, None, group).with_default_ulysses(shape.heads)
                layout.check_model(shape.heads)
            except (ConfigError, ValueError) as exc:
                notes.append(f"{s} on {n} node(s): {exc}")
                continue
            f = fraction
            if s == "ditango" and plan_log is not None:
                f = map_plan_offsets(plan_log, layout.groups)  # per ring offset, by relative distance
            est = estimate(hw, layout, shape, height, width, frames, steps,
                           compute_fraction=f if s == "ditango" else 1.0)  # fmt: skip
            found.append(
                (est, memory_row(shape, layout, height, width, frames, memory, vae_parallel, gpu_memory_bytes))
            )
        exact = [e.e2e_s for e, _ in found if e.strategy != "ditango"]
        best = min(exact) if exact else None
        for e, mem in found:
            rows.append(
                {"strategy": e.strategy, "nodes": e.nodes, "gpus_per_node": e.gpus_per_node,
                 "attention_s": round(e.attention_s, 6), "step_s": round(e.step_s, 6), "e2e_s": round(e.e2e_s, 4),
                 "inter_node_bytes": e.inter_node_bytes, "intra_node_bytes": e.intra_node_bytes,
                 "speedup_vs_best_exact": None if best is None else round(best / e.e2e_s, 4), **mem}
            )  # fmt: skip
    return rows, notes
