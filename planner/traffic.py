"""Exact byte counts: what the runtime moves for a layout, transfer by transfer.

The runtime counts on the receiver, by the link the bytes crossed (runtime/comm.py); these
predictions equal its counters exactly for the same shapes and plan
(tests/test_cost_model.py). Notation as in planner/cost_model.py.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from planner.ditango import unit_offsets
from planner.layout import ParallelLayout, chunk_sizes, rank_groups, virtual_node_map
from planner.models import ModelShape, VideoSize


@dataclass
class Traffic:
    """Bytes received, summed over ranks: {purpose: {"intra_node_bytes"|"inter_node_bytes": n}}."""

    bytes: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    # The same by receiving rank: {rank: {"intra_node_bytes"|"inter_node_bytes": n}}
    by_rank: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, purpose: str, link: str, n: int, rank: int) -> None:
        """`rank` received `n` bytes for `purpose` over a `link`."""
        self.bytes[purpose][f"{link}_bytes"] += n
        self.by_rank[rank][f"{link}_bytes"] += n

    def add_times(self, other: Traffic, times: int) -> None:
        """Add `other`'s bytes `times` over (a pattern priced once that repeats)."""
        for purpose, links in other.bytes.items():
            for k, n in links.items():
                self.bytes[purpose][k] += times * n
        for rank, links in other.by_rank.items():
            for k, n in links.items():
                self.by_rank[rank][k] += times * n

    def rank_totals(self, rank: int) -> dict:
        """What `rank` received: {"intra_node_bytes", "inter_node_bytes"}."""
        got = self.by_rank.get(rank, {})
        return {k: got.get(k, 0) for k in ("intra_node_bytes", "inter_node_bytes")}

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

    def group_link(self, ranks) -> str:
        """The slowest link class inside a group of `ranks`: inter_node when they span nodes."""
        return "inter_node" if len({self.node_of[r] for r in ranks}) > 1 else "intra_node"


def ring_all_reduce_bytes(nbytes: int, n: int) -> int:
    """What each of `n` ranks receives in a ring all-reduce of `nbytes` (NCCL's ring: a
    reduce-scatter then an all-gather, n - 1 chunks of nbytes / n each, from the predecessor):
    2 (n - 1) / n of the tensor, rounded down."""
    return 2 * (n - 1) * nbytes // n


def tp_all_reduces(shape: ModelShape, tokens: int, e: int) -> list[int]:
    """Bytes of each all-reduce tensor parallelism runs in one block for one forward (batch 1):
    three [S, C] in the model dtype (the row-wise outputs: self-attention, cross-attention,
    FFN down-projection) and the float32 [S, 1] sums of squares of the RMS norms across heads
    (self-attention q and k; cross-attention q, the text keys, and the image keys of I2V)."""
    C = shape.hidden
    stats = [tokens, tokens, tokens, shape.text_len] + ([shape.image_tokens] if shape.image_tokens else [])
    return [tokens * C * e] * 3 + [4 * n for n in stats]


def ring_hops(t: Traffic, topo: Topology, ranks, block_bytes: list[int], purpose: str, times: int) -> None:
    """Ring over `ranks` where member j holds a block of block_bytes[j]: P-1 hops, each rank
    receiving from its predecessor the block that started (k+1) positions behind it."""
    P = len(ranks)
    total = sum(block_bytes)
    for me in range(P):  # over the P-1 hops: every block but its own, all from its predecessor
        if P > 1:
            t.add(purpose, topo.link(ranks[me], ranks[(me - 1) % P]), times * (total - block_bytes[me]), ranks[me])


def attention_traffic(
    t: Traffic,
    topo: Topology,
    shape: ModelShape,
    tokens: int,
    e: int,
    forwards: int,
    plan_bits=None,
    own_group: str = "decide",
) -> None:
    """Self-attention bytes of every rank for `forwards` forward passes of all layers.

    `plan_bits` (DiTango only): list over forwards of [layers][units] compute booleans, the
    units as `planner.ditango.unit_offsets` lists them for `own_group`.
    """
    sizes = chunk_sizes(tokens, topo.layout.cp_degree)
    for cp_ranks in topo.groups["cp"]:
        topo.layout.strategy.attention_traffic(t, topo, cp_ranks, sizes, shape, e, forwards, plan_bits, own_group)


def ditango_units(layout: ParallelLayout, own_group: str, plan_units: int | None = None) -> list[tuple[int, ...]]:
    """The decision units of a plan with `plan_units` columns (None: compose factor 1)."""
    own = int(own_group == "decide" and layout.group > 1)
    remote = layout.groups - 1 if plan_units is None else plan_units - own
    k = math.ceil((layout.groups - 1) / remote) if remote > 0 else 1
    return unit_offsets(layout.groups, layout.group, own_group, k)


def unit_fractions(compute_fraction: float | list[float], layout, own_group: str) -> list[float]:
    """Computed fraction per decision unit of `layout` (a scalar applies to every unit)."""
    units = ditango_units(layout, own_group)
    if isinstance(compute_fraction, (int, float)):
        return [float(compute_fraction)] * len(units)
    assert len(compute_fraction) == len(units), (len(compute_fraction), units)
    return [float(f) for f in compute_fraction]


def gather_traffic(t: Traffic, topo: Topology, shape: ModelShape, tokens: int, e: int, forwards: int) -> None:
    """proj_out all-gather: every rank receives each peer's (padded) chunk of the output
    (nothing under tp: every rank computes the whole output)."""
    if topo.layout.strategy.splits_weights:
        return
    sizes = chunk_sizes(tokens, topo.layout.cp_degree)
    block = max(sizes) * shape.out_channels * e
    for cp_ranks in topo.groups["cp"]:
        if len(cp_ranks) == 1:
            continue
        per_node = Counter(topo.node_of[r] for r in cp_ranks)
        for a in cp_ranks:  # a chunk from each peer: those of its node, then the others
            near = per_node[topo.node_of[a]] - 1
            t.add("gather", "intra_node", forwards * block * near, a)
            t.add("gather", "inter_node", forwards * block * (len(cp_ranks) - 1 - near), a)


def joint_traffic(t: Traffic, topo: Topology, shape: ModelShape, forwards: int) -> None:
    """Joint text-video attention (`shape.joint_text`): per layer and forward, every cp rank
    receives each peer's float32 state (out and lse) of the text rows over its own chunk."""
    if not shape.joint_text:
        return
    block = shape.text_len * shape.heads * (shape.head_dim + 1) * 4
    for cp_ranks in topo.groups["cp"]:
        for a in cp_ranks:
            for b in cp_ranks:
                if a != b:
                    t.add("joint", topo.link(a, b), forwards * shape.layers * block, a)


def fsdp_traffic(t: Traffic, topo: Topology, shape: ModelShape, e: int, forwards: int, roots: int) -> None:
    """--shard-weights: every forward all-gathers the transformer's FSDP units over each cp
    group, and `roots` first forwards (one per transformer) its root unit, each rank receiving
    every peer's shard (a 1/n of every parameter: exact where n divides their first
    dimensions, as it does for the registry's models on 2..64 ranks)."""
    for ranks in topo.groups["cp"]:
        n = len(ranks)
        if n == 1:
            continue
        shard = (forwards * shape.fsdp_gathered_params // n + roots * shape.fsdp_root_gathered_params // n) * e
        for a in ranks:
            for b in ranks:
                if a != b:
                    t.add("weights", topo.link(a, b), shard, a)


def step_cache_traffic(t: Traffic, topo: Topology, agreements: int) -> None:
    """A step cache's decisions agreed over each cp group (runtime/step_cache.py, the control
    convention): `agreements` all-reduces of two float32 sums (first-block: every forward
    but those of the first step, which has no previous residual)."""
    for ranks in topo.groups["cp"]:
        for a in ranks:
            for b in ranks:
                if a != b:
                    t.add("control", topo.link(a, b), agreements * 8, a)


def cfg_traffic(t: Traffic, topo: Topology, latent_numel: int, e: int, steps: int) -> None:
    """CFG-parallel: each rank receives its partner's full prediction once per step."""
    for pair in topo.groups["cfg"]:
        if len(pair) == 2:
            a, b = pair
            for receiver in (a, b):
                t.add("cfg", topo.link(a, b), steps * latent_numel * e, receiver)


def control_traffic(
    t: Traffic, topo: Topology, layers: int, units: int, kinds: list[str], planner: str = "hpdc"
) -> None:
    """DiTango's control plane (runtime/comm.py's convention: an all-reduce counts the tensor
    once per peer): the plan check every step (2 int64) and, on the steps the planner
    observes (selective; anchors too for the budget planner), its statistics (layers x units
    + 1 float32), over the plan group (the world with cfg 2)."""
    layout = topo.layout
    plan_groups = topo.groups["cp"] if layout.cfg_degree == 1 else [tuple(range(layout.world_size))]
    observed = ("selective", "anchor") if planner == "budget" else ("selective",)
    per_step = [16 + ((layers * units + 1) * 4 if kind in observed else 0) for kind in kinds]
    for group in plan_groups:
        for a in group:
            for b in group:
                if a != b:
                    t.add("control", topo.link(a, b), sum(per_step), a)


def predict_traffic(
    layout: ParallelLayout,
    shape: ModelShape,
    size: VideoSize,
    steps: int,
    *,
    guidance: bool = True,
    element_bytes: int = 2,
    plan_bits=None,
    plan_kinds: list[str] | None = None,
    node_of: tuple[int, ...] | None = None,
    own_group: str = "decide",
    planner: str = "hpdc",
    rank: int | None = None,
    shard_weights: bool = False,
    roots: int | None = None,
    step_cache: str | None = None,
    first_step: bool = True,
) -> dict:
    """Bytes of one item, summed over ranks, in the report's `comm` format (`rank`: only what
    that rank received, {"intra_node_bytes", "inter_node_bytes"}; `shard_weights`: with FSDP's
    weight gathers, `roots` of them the transformers' root units; `step_cache`: its agreements,
    none on the first step when `first_step`). With DiTango's
    `plan_kinds` (each step's kind, from its plan file) the control plane is counted too."""
    topo = Topology(layout, node_of)
    tokens = shape.tokens(size)
    branches = shape.guided_forwards if guidance or shape.own_guidance else 1
    forwards = steps * (1 if layout.cfg_degree == 2 else branches)
    t = Traffic()
    attention_traffic(t, topo, shape, tokens, element_bytes, forwards, plan_bits, own_group)
    layout.strategy.weight_traffic(t, topo, shape, tokens, element_bytes, forwards)
    gather_traffic(t, topo, shape, tokens, element_bytes, forwards)
    joint_traffic(t, topo, shape, forwards)
    if shard_weights:  # `roots` None: each transformer's root once (the item is a run's first)
        experts = max(1, round(shape.params / max(1, shape.root_params + shape.fsdp_gathered_params)))
        fsdp_traffic(t, topo, shape, element_bytes, forwards, experts if roots is None else roots)
    if step_cache == "first-block":  # its agreement, on every step but the run's first
        step_cache_traffic(t, topo, forwards - (forwards // steps if first_step else 0))
    if layout.cfg_degree == 2:
        cfg_traffic(t, topo, math.prod(shape.latent_shape(size)) * shape.latent_channels, element_bytes, steps)
    if layout.strategy.reuses and plan_kinds is not None:  # the plan check runs with one group too
        units = len(plan_bits[0][0]) if plan_bits else len(ditango_units(layout, own_group))
        control_traffic(t, topo, shape.layers, units, plan_kinds, planner)
    return t.totals() if rank is None else t.rank_totals(rank)


def plan_bits_from_log(plan_log: dict, layers: int, branches: int) -> list:
    """Per forward (step-major, branch-minor) [layers][units] compute bits from a plan file."""
    bits = []
    for step in plan_log["steps"]:
        rows = [[c == "1" for c in row] for row in step["compute"]]
        bits.extend([rows] * branches)
    assert all(len(r) == layers for r in bits)
    return bits
