"""What a parallel strategy is, and the registry of them.

A strategy is one object (a `Strategy` subclass, registered once by name) that says
everything the tool asks of it: its `--parallel` name and help, the layout options it takes
and the degrees it derives from a layout, its rules, its label and flags in the layout
search, the bytes it moves and the time it takes in the cost model, what its memory holds,
and which runtime module runs it. Nothing elsewhere compares a strategy's name: the
planner, the cost model, the layout search, the runtime and the CLI ask the object.

The built-in strategies are planner/strategies/ (registered when the planner package loads);
a new one is a module there and one line in its `__init__`, or `register` from anywhere
before its first layout.

Shapes: `layout` a planner.layout.ParallelLayout, `topo` a planner.traffic.Topology, `hw` a
planner.cost_model.Hardware, `t` a planner.traffic.Traffic; `sizes` the cp chunk sizes, `e`
bytes per element of the model dtype.
"""

from __future__ import annotations

from typing import NamedTuple

from basics.errors import ConfigError

DEFAULT_CP = "ring"  # the strategy of several cp ranks when none is named
LAYOUT_OPTIONS = {"ulysses_degree": "--ulysses-degree", "group_size": "--group-size"}


class Degrees(NamedTuple):
    """How a strategy splits the cp axis (their product over the axes it uses is its size)."""

    group: int = 1  # adjacent cp ranks computed fresh together (DiTango)
    ulysses: int = 1  # the head all-to-all's degree
    ring: int = 1  # the ring's degree
    tp: int = 1  # tensor parallelism's degree


class Strategy:
    """One parallel strategy. The defaults are those of a strategy that splits the token
    sequence over the cp axis and moves nothing (one rank); subclasses override what differs."""

    name: str = ""  # --parallel NAME; the layout's "strategy" in every JSON file
    summary: str = ""  # one line: the CLI's help and the manual's table
    options: tuple[str, ...] = ()  # the layout options it takes (LAYOUT_OPTIONS' keys)
    runtime: str | None = None  # the runtime module whose `build` runs it; None: the model runs as loaded
    reuses: bool = False  # reuses cached attention states (lossy): DiTango's options and cache apply
    splits_weights: bool = False  # splits the blocks' weights instead of the tokens: every rank holds all tokens
    with_hybrid: bool = True  # combines with --hybrid (Hybridiff's segments)

    # -- pickling: a layout's strategy comes back as the registered object -------------
    def __reduce__(self):
        return strategy_named, (self.name,)

    def __eq__(self, other) -> bool:
        if isinstance(other, str):  # a name compared is a rule written outside its strategy
            raise TypeError(f"compare strategy {self.name} by what it does (its attributes), not by name")
        return self is other

    __hash__ = object.__hash__

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    # -- the layout ----------------------------------------------------------------------
    def degrees(self, layout) -> Degrees:
        """The degrees of `layout`'s cp axis (`layout.cp_degree` and its options are set)."""
        return Degrees(ring=layout.cp_degree)

    def check(self, layout) -> None:
        """Rules of this strategy beyond the layout's own (ConfigError)."""

    def with_defaults(self, layout, heads: int):
        """`layout` with the options left to the strategy chosen for a model of `heads` heads."""
        return layout

    def idle(self, layout, own_group: str = "decide") -> str | None:
        """A note when this strategy changes nothing on `layout` (None: it does its work);
        `own_group`: DiTango's --own-group, what its own group's other ranks get."""
        if layout.cp_degree == 1:
            return (
                f"--parallel {self.name} on {layout.world_size} rank(s) splits no sequence (one rank per CFG "
                "branch): every step is one process's"
            )
        return None

    def label(self, layout) -> str:
        """What the layout search calls it on `layout`'s cp axis (several ranks)."""
        return f"{self.name} {layout.cp_degree}"

    def degrees_text(self, layout) -> str:
        """Its degrees on `layout`, for a run's first line."""
        return f"ulysses {layout.ulysses} x ring {layout.ring}"

    def flags(self, layout) -> list[str]:
        """The options of `generate` that give it on `layout`'s cp axis."""
        return ["--parallel", self.name]

    def variants(self, cp: int) -> list[dict]:
        """The layouts the search tries on `cp` ranks: their options, as ParallelLayout keywords."""
        return [{}]

    # -- the cost model ------------------------------------------------------------------
    def attention_traffic(self, t, topo, cp_ranks, sizes, shape, e: int, forwards: int, plan_bits, own_group: str):
        """Add the self-attention bytes of one cp group's ranks over `forwards` forwards of every
        layer to `t` (`plan_bits`: a reusing strategy's [forward][layer][unit] compute bits)."""

    def attention_time(self, hw, topo, shape, sizes, e: int, compute_fraction, own_group: str) -> float:
        """One layer's self-attention of the video tokens for one forward on the slowest rank
        (`compute_fraction`: a reusing strategy's computed share per decision unit)."""
        raise NotImplementedError(self.name)

    def block_tokens(self, tokens: int, sizes) -> int:
        """The tokens one rank's block runs its projections and FFN on."""
        return max(sizes)

    def weight_traffic(self, t, topo, shape, tokens: int, e: int, forwards: int) -> None:
        """Add the bytes a weight-splitting strategy moves inside the blocks to `t`."""

    def weight_time(self, hw, topo, shape, tokens: int, e: int) -> float:
        """One block's time in a weight-splitting strategy's collectives for one forward."""
        return 0.0

    def merges_states(self, layout) -> bool:
        """Whether a rank keeps running attention states (out, lse) to merge partitions into."""
        return False


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` known by its name (`--parallel`, layouts, JSON files); a name is taken once."""
    if not strategy.name or strategy.name in STRATEGIES:
        raise ValueError(f"a strategy needs a name not taken yet, got {strategy.name!r}")
    STRATEGIES[strategy.name] = strategy
    return strategy


def strategy_named(name: str) -> Strategy:
    """The registered strategy called `name`, or a one-line ConfigError naming those there are."""
    found = STRATEGIES.get(name) if isinstance(name, str) else None
    if found is None:
        known = ", ".join(n for n, s in STRATEGIES.items() if s.runtime is not None)
        raise ConfigError(f"--parallel must be one of {known}, got {name!r}")
    return found
