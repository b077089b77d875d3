"""Topology/hardware cost model: exact byte counts, modelled time.

The byte half reproduces, transfer by transfer, what the runtime moves (runtime/comm.py
counts on the receiver, by the link the bytes crossed), so its predictions equal the
runtime's counters exactly for the same shapes and plan (tests/test_cost_model.py).
The time half prices those bytes and the FLOPs on a hardware profile; its assumptions are
listed in `ASSUMPTIONS` and printed by `ditango simulate`.

Notation: P cp ranks with chunk sizes s_j (uneven, runtime/strategies/sharding.py), H heads,
D head dim, e bytes per element of the transformer dtype, B batch (1), F forwards per
rank per step (2 for CFG run in turn, 1 per rank with --cfg-parallel).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.errors import ConfigError
from runtime.mesh import ParallelLayout, rank_groups, virtual_node_map
from runtime.strategies.sharding import chunk_sizes

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


# Public datasheet numbers (dense bf16, no sparsity). NVLink "900 GB/s" is bidirectional:
# 450 GB/s per direction. NICs: the common 8-GPU server build of each generation, one NIC
# per GPU (400 Gb/s NDR = 50 GB/s; 200 Gb/s HDR = 25 GB/s).
HARDWARE: dict[str, Hardware] = {
    "h20": Hardware("h20", 148.0, 4.0, 450.0, 50.0, 10.0, "NVIDIA H20 datasheet: 148 TFLOPS bf16, 4.0 TB/s, NVLink 900 GB/s"),
    "h100": Hardware("h100", 989.0, 3.35, 450.0, 50.0, 10.0, "NVIDIA H100 SXM datasheet: 989 TFLOPS bf16, 3.35 TB/s, NVLink 900 GB/s"),
    "h200": Hardware("h200", 989.0, 4.8, 450.0, 50.0, 10.0, "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16, 4.8 TB/s, NVLink 900 GB/s"),
    "a100": Hardware("a100", 312.0, 2.0, 300.0, 25.0, 10.0, "NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS bf16, 2.0 TB/s, NVLink 600 GB/s"),
    "l40s": Hardware("l40s", 362.0, 0.864, 32.0, 25.0, 10.0, "NVIDIA L40S datasheet: 362 TFLOPS bf16, 864 GB/s; PCIe Gen4 x16, no NVLink"),
}  # fmt: skip

ASSUMPTIONS = {
    "matmul_efficiency": 0.7,  # achieved / peak for projections and FFN
    "attention_efficiency": 0.5,  # achieved / peak for attention kernels (flash-attn class)
    "link_efficiency": 0.8,  # achieved / nominal bandwidth
    "overlap": "ring/DiTango hops: max(compute, transfer) + latency (next block prefetched)",
    "not_modelled": "text encoder, VAE decode, scheduler step, kernel launch overheads, stragglers",
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


# -- model shapes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    heads: int
    head_dim: int
    ffn: int
    text_len: int
    text_dim: int = 4096
    latent_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)
    vae_stride: tuple[int, int, int] = (4, 8, 8)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def out_channels(self) -> int:
        return self.latent_channels * math.prod(self.patch)

    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        t, s, _ = self.vae_stride
        return ((frames - 1) // t + 1, height // s, width // s)

    def tokens(self, height: int, width: int, frames: int) -> int:
        f, h, w = self.latent_shape(height, width, frames)
        return (f // self.patch[0]) * (h // self.patch[1]) * (w // self.patch[2])


# Transformer configs of the public checkpoints. HunyuanVideo (13B) is approximated as 60
# uniform blocks of its width (it has 20 dual-stream + 40 single-stream blocks).
MODELS: dict[str, ModelShape] = {
    "wan2.1-1.3b": ModelShape("wan2.1-1.3b", layers=30, heads=12, head_dim=128, ffn=8960, text_len=512),
    "wan2.1-14b": ModelShape("wan2.1-14b", layers=40, heads=40, head_dim=128, ffn=13824, text_len=512),
    "hunyuanvideo": ModelShape("hunyuanvideo", layers=60, heads=24, head_dim=128, ffn=12288, text_len=256),
    "tiny-wan": ModelShape(
        "tiny-wan",
        layers=4,
        heads=4,
        head_dim=48,
        ffn=768,
        text_len=32,
        text_dim=32,
        latent_channels=12,
        patch=(1, 2, 2),
        vae_stride=(4, 4, 4),
    ),
}


# -- exact byte counts -------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes received, summed over ranks: {purpose: {"intra_node_bytes"|"inter_node_bytes": n}}."""

    bytes: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, purpose: str, link: str, n: int) -> None:
        self.bytes[purpose][f"{link}_bytes"] += n

    def totals(self) -> dict:
        out = {"intra_node_bytes": 0, "inter_node_bytes": 0, "by_purpose": {}}
        for purpose, links in sorted(self.bytes.items()):
            out["by_purpose"][purpose] = {k: v for k, v in sorted(links.items()) if v}
            for k, v in links.items():
                out[k] += v
        out["by_purpose"] = {p: v for p, v in out["by_purpose"].items() if v}
        return out


class Topology:
    def __init__(self, layout: ParallelLayout, node_of: tuple[int, ...] | None = None) -> None:
        self.layout = layout
        self.node_of = node_of or virtual_node_map(layout)
        self.groups = rank_groups(layout)

    def link(self, a: int, b: int) -> str:
        return "intra_node" if self.node_of[a] == self.node_of[b] else "inter_node"


def _ring_hops(t: Traffic, topo: Topology, ranks, block_bytes: list[int], purpose: str, times: int) -> None:
    """Ring over `ranks` where member j holds a block of block_bytes[j]: P-1 hops, each rank
    receiving from its predecessor the block that started (k+1) positions behind it."""
    P = len(ranks)
    for me in range(P):
        link = topo.link(ranks[me], ranks[(me - 1) % P])
        for k in range(P - 1):
            t.add(purpose, link, times * block_bytes[(me - k - 1) % P])


def attention_traffic(
    t: Traffic, topo: Topology, shape: ModelShape, tokens: int, e: int, forwards: int, plan_bits=None
) -> None:
    """Self-attention bytes of every rank for `forwards` forward passes of all layers.

    `plan_bits` (DiTango only): list over forwards of [layers][units] compute booleans.
    """
    layout = topo.layout
    H, D, L = shape.heads, shape.head_dim, shape.layers
    sizes = chunk_sizes(tokens, layout.cp_degree)
    for cp_ranks in topo.groups["cp"]:
        if layout.strategy in ("ring", "ulysses", "usp"):
            u = layout.ulysses
            h = H // u
            for uly in [g for g in topo.groups["ulysses"] if g[0] in cp_ranks]:
                idx = [cp_ranks.index(r) for r in uly]
                for a, ra in zip(idx, uly, strict=True):
                    for b, rb in zip(idx, uly, strict=True):
                        if ra != rb:  # q, k, v in; our chunk's output back
                            t.add("attention", topo.link(ra, rb), forwards * L * (3 * sizes[b] + sizes[a]) * h * D * e)
            if layout.ring > 1:
                for ring in [g for g in topo.groups["ring"] if g[0] in cp_ranks]:
                    spans = [sum(sizes[(cp_ranks.index(r) // u) * u : (cp_ranks.index(r) // u + 1) * u]) for r in ring]
                    _ring_hops(t, topo, ring, [2 * s * h * D * e for s in spans], "attention", forwards * L)
        elif layout.strategy == "ditango":
            _ditango_traffic(t, topo, cp_ranks, sizes, shape, e, forwards, plan_bits)


def _ditango_traffic(t, topo: Topology, cp_ranks, sizes, shape: ModelShape, e: int, forwards: int, plan_bits) -> None:
    layout = topo.layout
    size, G, P = layout.group, layout.groups, layout.cp_degree
    H, D, L = shape.heads, shape.head_dim, shape.layers
    kv = [2 * s * H * D * e for s in sizes]
    groups = [cp_ranks[g * size : (g + 1) * size] for g in range(G)]
    # Own group, every forward and layer: a ring inside the group.
    for g in range(G):
        _ring_hops(t, topo, groups[g], kv[g * size : (g + 1) * size], "attention", forwards * L)
    units = 0 if plan_bits is None or not plan_bits else len(plan_bits[0][0])
    k = math.ceil((G - 1) / units) if units else 1
    for f in range(forwards):
        for layer in range(L):
            for d in range(1, G):
                unit = (d - 1) // k
                if plan_bits is not None and not plan_bits[f][layer][unit]:
                    continue  # reused: nothing moves
                for c in range(P):  # direct fetch from I*d ahead
                    src = (c + size * d) % P
                    t.add("attention", topo.link(cp_ranks[c], cp_ranks[src]), kv[src])
                for g in range(G):  # then around the group ring: the remote group's other chunks
                    remote = ((g + d) % G) * size
                    _ring_hops(t, topo, groups[g], kv[remote : remote + size], "attention", 1)


def gather_traffic(t: Traffic, topo: Topology, shape: ModelShape, tokens: int, e: int, forwards: int) -> None:
    """proj_out all-gather: every rank receives each peer's (padded) chunk of the output."""
    sizes = chunk_sizes(tokens, topo.layout.cp_degree)
    block = max(sizes) * shape.out_channels * e
    for cp_ranks in topo.groups["cp"]:
        if len(cp_ranks) == 1:
            continue
        for a in cp_ranks:
            for b in cp_ranks:
                if a != b:
                    t.add("gather", topo.link(a, b), forwards * block)


def cfg_traffic(t: Traffic, topo: Topology, latent_numel: int, e: int, steps: int) -> None:
    """CFG-parallel: each rank receives its partner's full prediction once per step."""
    for pair in topo.groups["cfg"]:
        if len(pair) == 2:
            a, b = pair
            t.add("cfg", topo.link(a, b), 2 * steps * latent_numel * e)


def predict_traffic(
    layout: ParallelLayout,
    shape: ModelShape,
    height: int,
    width: int,
    frames: int,
    steps: int,
    *,
    guidance: bool = True,
    element_bytes: int = 2,
    plan_bits=None,
    node_of: tuple[int, ...] | None = None,
) -> dict:
    """Bytes of one item, summed over ranks, in the report's `comm` format."""
    topo = Topology(layout, node_of)
    tokens = shape.tokens(height, width, frames)
    branches = 2 if guidance else 1
    forwards = steps * (1 if layout.cfg_degree == 2 else branches)
    t = Traffic()
    attention_traffic(t, topo, shape, tokens, element_bytes, forwards, plan_bits)
    gather_traffic(t, topo, shape, tokens, element_bytes, forwards)
    if layout.cfg_degree == 2:
        cfg_traffic(t, topo, math.prod(shape.latent_shape(height, width, frames)) * shape.latent_channels,
                    element_bytes, steps)  # fmt: skip
    return t.totals()


def plan_bits_from_log(plan_log: dict, layers: int, branches: int) -> list:
    """Per forward (step-major, branch-minor) [layers][units] compute bits from a plan file."""
    bits = []
    for step in plan_log["steps"]:
        rows = [[c == "1" for c in row] for row in step["compute"]]
        bits.extend([rows] * branches)
    assert all(len(r) == layers for r in bits)
    return bits


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
    """Projections, cross-attention and FFN of one block on one rank's tokens."""
    n, hid = local_tokens, shape.hidden
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
        one = ModelShape(**{**asdict(shape), "layers": 1})
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
