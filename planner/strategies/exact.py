"""Ring, Ulysses and USP: the exact context-parallel strategies, one composition.

USP runs Ulysses (a head all-to-all) over `ulysses` adjacent cp ranks, then ring attention
over the remaining `ring` degree; ring is USP with Ulysses degree 1, Ulysses is USP with ring
degree 1 (runtime/strategies/exact.py runs all three).
"""

from __future__ import annotations

from dataclasses import replace

from basics.errors import ConfigError
from planner.cost_model import bandwidth, latency, ring_seconds
from planner.layout import divisors
from planner.strategy import Degrees, Strategy
from planner.traffic import ring_hops


class ExactCP(Strategy):
    """What ring, Ulysses and USP share: every KV chunk fresh every step, priced as the
    Ulysses all-to-all (q, k, v in, the output back) and then the ring over the rest."""

    runtime = "runtime.strategies.exact"

    def merges_states(self, layout) -> bool:
        return layout.ring > 1

    def attention_traffic(self, t, topo, cp_ranks, sizes, shape, e, forwards, plan_bits, own_group):
        layout = topo.layout
        u, D, L = layout.ulysses, shape.head_dim, shape.layers
        h = shape.heads // u
        for uly in [g for g in topo.groups["ulysses"] if g[0] in cp_ranks]:
            idx = [cp_ranks.index(r) for r in uly]
            for a, ra in zip(idx, uly, strict=True):
                for b, rb in zip(idx, uly, strict=True):
                    if ra != rb:  # q, k, v in; our chunk's output back
                        received = forwards * L * (3 * sizes[b] + sizes[a]) * h * D * e
                        t.add("attention", topo.link(ra, rb), received, ra)
        if layout.ring > 1:
            for ring in [g for g in topo.groups["ring"] if g[0] in cp_ranks]:
                spans = [sum(sizes[(cp_ranks.index(r) // u) * u : (cp_ranks.index(r) // u + 1) * u]) for r in ring]
                ring_hops(t, topo, ring, [2 * s * h * D * e for s in spans], "attention", forwards * L)

    def attention_time(self, hw, topo, shape, sizes, e, compute_fraction, own_group) -> float:
        layout = topo.layout
        u, D = layout.ulysses, shape.head_dim
        h = shape.heads // u
        t = 0.0
        if u > 1:
            uly = topo.groups["ulysses"][0]
            link = topo.group_link(uly)
            a2a = (3 + 1) * max(sizes) * h * D * e * (u - 1)
            t += a2a / bandwidth(hw, link) + 2 * (u - 1) * latency(hw, link)
        spans = [sum(sizes[i * u : (i + 1) * u]) for i in range(layout.ring)]
        return t + ring_seconds(hw, topo, topo.groups["ring"][0], max(spans), spans, h, D, e)


class Ring(ExactCP):
    name = "ring"
    summary = "ring attention: K and V pass around the cp ranks, exact"


class Ulysses(ExactCP):
    name = "ulysses"
    summary = "Ulysses: a head all-to-all, each rank attends its heads over all tokens, exact"

    def degrees(self, layout) -> Degrees:
        return Degrees(ulysses=layout.cp_degree)


class Usp(ExactCP):
    name = "usp"
    summary = "USP: Ulysses over --ulysses-degree adjacent ranks, the ring over the rest, exact"
    options = ("ulysses_degree",)

    def degrees(self, layout) -> Degrees:
        u = layout.ulysses_degree or 1
        return Degrees(ulysses=u, ring=layout.cp_degree // u)

    def check(self, layout) -> None:
        u = layout.ulysses_degree
        if u is not None and (u < 1 or layout.cp_degree % u):
            legal = ", ".join(map(str, divisors(layout.cp_degree)))
            raise ConfigError(f"--ulysses-degree {u} must divide the cp degree {layout.cp_degree} (try {legal})")

    def with_defaults(self, layout, heads: int):
        """Without --ulysses-degree: the largest degree dividing heads that stays inside a node."""
        if layout.ulysses_degree is not None:
            return layout
        per_node = layout.cp_degree if layout.nodes == 1 else layout.gpus_per_node
        best = max(d for d in divisors(layout.cp_degree) if heads % d == 0 and per_node % d == 0)
        return replace(layout, ulysses_degree=best)

    def label(self, layout) -> str:
        return f"usp {layout.ulysses}x{layout.ring}"

    def flags(self, layout) -> list[str]:
        return [*super().flags(layout), "--ulysses-degree", str(layout.ulysses)]

    def variants(self, cp: int) -> list[dict]:
        return [{"ulysses_degree": u} for u in divisors(cp) if 1 < u < cp]


RING, ULYSSES, USP = Ring(), Ulysses(), Usp()
