"""Tensor parallelism: the cp axis splits every block's heads and FFN width, not the tokens.

Every rank holds the whole token sequence and 1/n of each block's weights; the row-wise
outputs and the RMS norms' statistics are all-reduced inside each block
(runtime/strategies/tensor.py). No joint text-video blocks yet (planner.layout
`check_model`).
"""

from __future__ import annotations

from planner.cost_model import attention_seconds, bandwidth, latency
from planner.strategy import Degrees, Strategy
from planner.traffic import ring_all_reduce_bytes, tp_all_reduces


class TensorParallel(Strategy):
    name = "tp"
    summary = "tensor parallelism: each rank holds 1/n of every block's heads and FFN, all tokens, exact"
    runtime = "runtime.strategies.tensor"
    splits_weights = True
    with_hybrid = False

    def degrees(self, layout) -> Degrees:
        return Degrees(tp=layout.cp_degree)

    def label(self, layout) -> str:
        return f"tp {layout.tp}"

    def degrees_text(self, layout) -> str:
        return f"tp {layout.tp}"

    def block_tokens(self, tokens: int, sizes) -> int:
        return tokens

    def attention_time(self, hw, topo, shape, sizes, e, compute_fraction, own_group) -> float:
        """The local heads over the whole sequence (the all-reduces: `weight_time`)."""
        tokens = sum(sizes)
        return attention_seconds(hw, tokens, tokens, shape.heads // topo.layout.tp, shape.head_dim)

    def weight_traffic(self, t, topo, shape, tokens: int, e: int, forwards: int) -> None:
        """Every all-reduce of every block, as a ring over each cp group."""
        per_block = tp_all_reduces(shape, tokens, e)
        for ranks in topo.groups["cp"]:
            n = len(ranks)
            if n == 1:
                continue
            received = forwards * shape.layers * sum(ring_all_reduce_bytes(b, n) for b in per_block)
            for i, rank in enumerate(ranks):
                t.add("tp", topo.link(rank, ranks[(i - 1) % n]), received, rank)

    def weight_time(self, hw, topo, shape, tokens: int, e: int) -> float:
        """One block's all-reduces for one forward (planner/traffic.py `tp_all_reduces`), each a
        ring of 2(n-1) steps of 1/n of the tensor over the ring's slowest link, one after another
        (each result is needed before the block goes on)."""
        n = topo.layout.tp
        if n == 1:
            return 0.0
        ranks = topo.groups["cp"][0]
        link = topo.group_link(ranks)
        per_step = [b / n / bandwidth(hw, link) + latency(hw, link) for b in tp_all_reduces(shape, tokens, e)]
        return sum(2 * (n - 1) * s for s in per_step)


TP = TensorParallel()
