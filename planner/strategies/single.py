"""No parallel strategy: one rank (a branch's, with --cfg-parallel) runs the model as loaded,
with diffusers' own attention processor."""

from __future__ import annotations

from basics.errors import ConfigError
from planner.cost_model import attention_seconds
from planner.strategy import Strategy


class Single(Strategy):
    name = "none"
    summary = "one rank per branch: the model as diffusers runs it"

    def check(self, layout) -> None:
        if layout.cp_degree > 1:
            raise ConfigError(
                f"{layout.world_size} ranks need a context-parallel strategy: add --parallel ring, ulysses or usp"
            )

    def idle(self, layout, own_group: str = "decide") -> str | None:
        return None

    def label(self, layout) -> str:
        return "one GPU"

    def flags(self, layout) -> list[str]:
        return []

    def attention_time(self, hw, topo, shape, sizes, e, compute_fraction, own_group) -> float:
        tokens = sum(sizes)
        return attention_seconds(hw, tokens, tokens, shape.heads, shape.head_dim)


NONE = Single()
