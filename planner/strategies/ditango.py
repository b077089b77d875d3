"""DiTango: context parallelism that reuses far partitions' cached attention states.

The cp ranks form groups of `group` adjacent ranks; a group's own chunks are computed fresh
every step, the other groups' (the decision units of planner/ditango.py `unit_offsets`) as the
step's plan says: fresh, or merged from the state cached when they last were (docs/ALGORITHMS.md
2). runtime/strategies/ditango.py builds its runtime.
"""

from __future__ import annotations

from basics.errors import ConfigError
from planner.cost_model import bandwidth, hop_seconds, latency, ring_seconds
from planner.layout import divisors
from planner.strategy import Degrees, Strategy
from planner.traffic import Traffic, ditango_units, ring_hops, unit_fractions


def default_group(layout) -> int:
    """The group when --group-size is not given: on several nodes a node's ranks (the largest
    divisor of the cp degree up to them: a smaller group moves more bytes between nodes than
    the ring), on one node 2 (1 if the cp degree is odd)."""
    if layout.nodes > 1:
        return max(d for d in divisors(layout.cp_degree) if d <= layout.gpus_per_node)
    return 2 if layout.cp_degree % 2 == 0 else 1


def ditango_attention_time(
    hw, topo, heads: int, head_dim: int, sizes: list[int], e: int, fractions: list[float], own_group: str
) -> float:
    """DiTango on the slowest rank: each rank's own chunk, the ring over its group's other
    members (every forward, or as unit 0 decides), and per remote offset d, computed with
    its unit's fraction, the direct fetch from I*d ahead (the slowest rank's link: ranks at
    a group boundary may cross a node where rank 0 does not) overlapped with the ring of the
    remote group's chunks around the own group. A reused unit is merged from the cache (its
    bookkeeping: planner/reuse.py)."""
    layout = topo.layout
    cp_ranks = topo.groups["cp"][0]
    H, D, size, G, P = heads, head_dim, layout.group, layout.groups, layout.cp_degree
    q = max(sizes)
    units = ditango_units(layout, own_group)
    per_offset = {d: f for f, offs in zip(fractions, units, strict=True) for d in offs}
    groups = [cp_ranks[g * size : (g + 1) * size] for g in range(G)]

    def group_ring(d: int, hops: float = 1.0) -> float:  # every group rotating the chunks of the group d ahead
        return max(
            ring_seconds(hw, topo, groups[g], q, sizes[((g + d) % G) * size :][:size], H, D, e, hops) for g in range(G)
        )

    def fetch(c: int, d: int) -> float:  # rank c's direct fetch of its source's K, V
        src = (c + size * d) % P
        link = topo.link(cp_ranks[c], cp_ranks[src])
        return 2 * sizes[src] * H * D * e / bandwidth(hw, link) + latency(hw, link)

    total = group_ring(0, per_offset.get(0, 1.0))
    for d in range(1, G):
        total += per_offset[d] * hop_seconds(hw, group_ring(d), max(fetch(c, d) for c in range(P)))
    return total


class DiTango(Strategy):
    name = "ditango"
    summary = "DiTango: near KV partitions fresh, far ones reused from cached attention states (lossy)"
    options = ("group_size",)
    runtime = "runtime.strategies.ditango"
    reuses = True
    with_hybrid = False

    def degrees(self, layout) -> Degrees:
        group = layout.group_size if layout.group_size is not None else default_group(layout)
        return Degrees(group=group, ring=layout.cp_degree)

    def check(self, layout) -> None:
        g = layout.group_size
        if g is not None and (g < 1 or layout.cp_degree % g):
            legal = ", ".join(map(str, divisors(layout.cp_degree)))
            raise ConfigError(f"--group-size {g} must divide the cp degree {layout.cp_degree} (try {legal})")

    def idle(self, layout, own_group: str = "decide") -> str | None:
        """With one group: under --own-group fresh nothing is reused; under decide (the default)
        the group's other ranks are the only partitions that may be (decided as a remote group's)."""
        if layout.cp_degree > 1 and layout.groups == 1:
            if own_group == "fresh":
                return (
                    f"--parallel ditango with one group of {layout.group} ranks and --own-group fresh computes every "
                    "partition fresh (nothing is reused): the exact ring's work; a smaller --group-size reuses"
                )
            return (
                f"--parallel ditango with one group of {layout.group} ranks reuses only the partitions of the "
                "group's other ranks (--own-group decide: decided as a remote group's); a smaller --group-size "
                "reuses across groups"
            )
        return super().idle(layout, own_group)

    def label(self, layout) -> str:
        return f"ditango {layout.cp_degree}, group {layout.group}"

    def degrees_text(self, layout) -> str:
        return f"{super().degrees_text(layout)}, group size {layout.group}"

    def flags(self, layout) -> list[str]:
        return [*super().flags(layout), "--group-size", str(layout.group)]

    def variants(self, cp: int) -> list[dict]:
        return [{"group_size": g} for g in divisors(cp) if g < cp]

    def merges_states(self, layout) -> bool:
        return layout.cp_degree > 1

    def attention_time(self, hw, topo, shape, sizes, e, compute_fraction, own_group) -> float:
        fractions = unit_fractions(compute_fraction, topo.layout, own_group)
        return ditango_attention_time(hw, topo, shape.heads, shape.head_dim, sizes, e, fractions, own_group)

    def attention_traffic(self, t, topo, cp_ranks, sizes, shape, e, forwards, plan_bits, own_group):
        """The own group's ring every forward (or as unit 0 decides), and per computed unit the
        direct fetches from the group d ahead and the ring of its chunks around each group."""
        layout = topo.layout
        size, G, P = layout.group, layout.groups, layout.cp_degree
        H, D, L = shape.heads, shape.head_dim, shape.layers
        kv = [2 * s * H * D * e for s in sizes]
        groups = [cp_ranks[g * size : (g + 1) * size] for g in range(G)]
        units = ditango_units(layout, own_group, len(plan_bits[0][0]) if plan_bits else None)
        own_unit = bool(units) and units[0] == (0,)

        def own_ring(into: Traffic, times: int) -> None:  # a ring inside each group over its own chunks
            for g in range(G):
                ring_hops(into, topo, groups[g], kv[g * size : (g + 1) * size], "attention", times)

        if not own_unit:
            own_ring(t, forwards * L)  # the whole own group is computed every forward and layer
        # What one unit's computation moves is the same in every forward and layer: price it
        # once, then count the (forward, layer) pairs that compute it.
        for u, offsets in enumerate(units):
            if plan_bits is None:
                times = forwards * L
            else:
                times = sum(bool(plan_bits[f][layer][u]) for f in range(forwards) for layer in range(L))
            if times == 0:
                continue  # always reused: nothing moves
            once = Traffic()
            for d in offsets:
                if d == 0:
                    own_ring(once, 1)
                    continue
                for c in range(P):  # direct fetch from I*d ahead
                    src = (c + size * d) % P
                    once.add("attention", topo.link(cp_ranks[c], cp_ranks[src]), kv[src], cp_ranks[c])
                for g in range(G):  # then around the group ring: the remote group's other chunks
                    remote = ((g + d) % G) * size
                    ring_hops(once, topo, groups[g], kv[remote : remote + size], "attention", 1)
            t.add_times(once, times)


DITANGO = DiTango()
