"""How the ranks are laid out: the parallel layout (user intent), its rank groups and
node map, and how a token sequence is split over ranks. Pure arithmetic: the runtime builds
process groups from it (runtime/mesh.py), the cost model prices it (planner/cost_model.py).

Global rank order: rank = cfg_index * cp_degree + cp_index. Inside the cp axis, USP puts
Ulysses innermost (cp_index = ring_index * ulysses_degree + ulysses_index), so a Ulysses
group is a run of adjacent ranks, which share a node whenever ulysses_degree divides the
GPUs per node.

The layout's strategy (a registered object, planner/strategy.py) derives the cp axis's
degrees (Ulysses, ring, tensor-parallel, DiTango's group) and adds its own rules. Tensor
parallelism (`tp`) uses the cp axis as its group: every rank of it holds the whole token
sequence and 1/cp of each block's heads and FFN width (runtime/strategies/tensor.py).

Token chunks are uneven and contiguous, with no padding: rank i of P gets S // P tokens plus
one more when i < S % P (32,760 tokens over 16 ranks: 8 ranks of 2,048 and 8 of 2,047).
Every rank can compute every chunk's size from (S, P) alone, so receivers size their buffers
without a handshake, and attention needs no masking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from basics.errors import ConfigError
from planner.strategy import DEFAULT_CP, LAYOUT_OPTIONS, STRATEGIES, Strategy, strategy_named


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """How the world is split. world = nodes x gpus_per_node = cfg_degree x cp_degree."""

    nodes: int = 1
    gpus_per_node: int = 1
    cfg_degree: int = 1
    strategy: Strategy = "none"  # a registered Strategy (planner/strategy.py), or its name
    ulysses_degree: int | None = None  # usp only; None: the largest legal degree within a node
    # ditango only: adjacent cp ranks per group; None: the strategy's default (on several
    # nodes a node's ranks, on one node 2)
    group_size: int | None = None
    # Derived once from the fields above (a value, not a computation: read everywhere).
    world_size: int = field(init=False, repr=False, compare=False)
    cp_degree: int = field(init=False, repr=False, compare=False)  # world_size / cfg_degree
    group: int = field(init=False, repr=False, compare=False)  # DiTango: adjacent cp ranks computed fresh together
    groups: int = field(init=False, repr=False, compare=False)  # cp_degree / group
    ulysses: int = field(init=False, repr=False, compare=False)  # Ulysses (head all-to-all) degree in the cp axis
    ring: int = field(init=False, repr=False, compare=False)  # ring degree in the cp axis (1 under tp)
    tp: int = field(init=False, repr=False, compare=False)  # tensor-parallel degree: the cp axis under tp, else 1

    def __post_init__(self) -> None:
        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.strategy, Strategy):
            put("strategy", strategy_named(self.strategy))
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} and {self.gpus_per_node}")
        put("world_size", self.nodes * self.gpus_per_node)
        if self.cfg_degree not in (1, 2) or self.world_size % self.cfg_degree:
            raise ConfigError(f"cfg degree must be 1 or 2 and divide the world size {self.world_size}")
        put("cp_degree", self.world_size // self.cfg_degree)
        for option, flag in LAYOUT_OPTIONS.items():
            if getattr(self, option) is not None and option not in self.strategy.options:
                takers = " or ".join(f"--parallel {s}" for s in STRATEGIES.values() if option in s.options)
                raise ConfigError(f"{flag} only applies to {takers}")
        self.strategy.check(self)
        degrees = self.strategy.degrees(self)
        for name, value in degrees._asdict().items():
            put(name, value)
        put("groups", self.cp_degree // degrees.group)

    def check_model(
        self, heads: int, ffn: int | None = None, joint_text: bool = False, own_guidance: bool = False
    ) -> None:
        """Errors that depend on the model: Ulysses splits heads, so its degree must divide them;
        tp splits heads and the FFN width (`ffn`, when known); tp has no joint text-video
        (HunyuanVideo-style) blocks yet; a model whose pipeline guides with forwards of its own
        (`own_guidance`, LTX-2) runs every forward fresh on one rank group, context parallel."""
        if own_guidance and (self.cfg_degree > 1 or self.strategy.reuses or self.strategy.splits_weights):
            option = "--cfg-parallel" if self.cfg_degree > 1 else f"--parallel {self.strategy}"
            raise ConfigError(
                f"{option} does not apply to a model whose guidance runs up to four forwards a step (LTX-2: CFG, "
                "spatio-temporal, modality; an audio stream tp does not split); use ring, ulysses or usp"
            )
        if self.ulysses > 1 and heads % self.ulysses:
            best = max(d for d in divisors(self.cp_degree) if heads % d == 0)
            hint = "use --parallel ring" + (f", or --parallel usp --ulysses-degree {best}" if best > 1 else "")
            raise ConfigError(f"Ulysses degree {self.ulysses} must divide the model's {heads} attention heads; {hint}")
        if self.tp == 1:
            return
        if joint_text:
            raise ConfigError(
                "--parallel tp is not supported yet for joint text-video models (HunyuanVideo); use ring, ulysses or usp"
            )
        for what, n in (("attention heads", heads), ("FFN width", ffn)):
            if n is not None and n % self.tp:
                best = max(d for d in divisors(self.tp) if heads % d == 0 and (ffn is None or ffn % d == 0))
                hint = f", or tp over {best} ranks per cp group" if best > 1 else ""
                raise ConfigError(f"tp degree {self.tp} must divide the model's {n} {what}; use --parallel ring{hint}")

    def with_defaults(self, heads: int) -> ParallelLayout:
        """This layout with the options its strategy leaves to a model of `heads` heads."""
        return self.strategy.with_defaults(self, heads)

    def idle(self, own_group: str = "decide") -> str | None:
        """A note when the strategy asked for changes nothing here, or less than it may seem
        (None: it does its work); `own_group`: DiTango's --own-group."""
        return self.strategy.idle(self, own_group)

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "cfg_degree": self.cfg_degree,
            "cp_degree": self.cp_degree,
            "strategy": self.strategy.name,
            "ulysses_degree": self.ulysses,
            "ring_degree": self.ring,
            "group_size": self.group,
        }


def rank_groups(layout: ParallelLayout) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every kind, as global rank tuples, in a fixed order (all ranks agree)."""
    cp, u = layout.cp_degree, layout.ulysses
    cp_groups = [tuple(range(c * cp, (c + 1) * cp)) for c in range(layout.cfg_degree)]
    ulysses_groups, ring_groups, near_groups = [], [], []
    for base in (g[0] for g in cp_groups):
        for g in range(layout.groups):
            near_groups.append(tuple(base + g * layout.group + j for j in range(layout.group)))
        for r in range(cp // u):
            ulysses_groups.append(tuple(base + r * u + i for i in range(u)))
        for i in range(u):
            ring_groups.append(tuple(base + r * u + i for r in range(cp // u)))
    cfg_groups = [tuple(c + i * cp for i in range(layout.cfg_degree)) for c in range(cp)]
    return {"cp": cp_groups, "ulysses": ulysses_groups, "ring": ring_groups, "near": near_groups, "cfg": cfg_groups}


def virtual_node_map(layout: ParallelLayout) -> tuple[int, ...]:
    """Local runs: rank r sits on virtual node r // gpus_per_node."""
    return tuple(r // layout.gpus_per_node for r in range(layout.world_size))


def chunk_sizes(total: int, parts: int) -> list[int]:
    if total < parts:
        raise ValueError(f"cannot split {total} tokens over {parts} ranks: every rank needs at least one token")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunk_bounds(sizes: list[int], index: int) -> tuple[int, int]:
    start = sum(sizes[:index])
    return start, start + sizes[index]


def token_count(latent_fhw: tuple[int, int, int], patch: tuple[int, int, int]) -> int:
    """Length of the transformer's token sequence: the latent video [F, H, W] cut into patches."""
    return math.prod(n // p for n, p in zip(latent_fhw, patch, strict=True))


def replica_shape(nodes: int, gpus_per_node: int, replicas: int) -> tuple[int, int]:
    """(nodes, ranks per node) of one replica: replicas split the nodes, or split each node."""
    r, n, g = replicas, nodes, gpus_per_node
    if n % r == 0:
        return n // r, g
    if r % n == 0 and g % (r // n) == 0:
        return 1, g // (r // n)
    raise ConfigError(
        f"--replicas {r} must divide the {n} nodes, or split each node's {g} ranks evenly "
        f"(e.g. --replicas {n} or {n * g})"
    )


def parse_group_size(text: str, gpus_per_node: int) -> int:
    """--group-size: a number of ranks (ASCII digits), or 'node' (a node's ranks)."""
    if text != "node" and not (text.isascii() and text.isdigit()):
        raise ConfigError(f"--group-size must be a number of ranks or 'node', got {text!r}")
    return gpus_per_node if text == "node" else int(text)


def replica_layout(
    nodes: int,
    gpus_per_node: int,
    replicas: int,
    heads: int,
    *,
    strategy: str | None = None,
    cfg_parallel: bool = False,
    ulysses_degree: int | None = None,
    group_size: str | int | None = None,
    ffn: int | None = None,
    joint_text: bool = False,
    own_guidance: bool = False,
) -> ParallelLayout:
    """The layout of one replica of an allocation of `nodes` x `gpus_per_node` ranks (the whole
    allocation without replicas), for a model of `heads` heads (`ffn`, `joint_text`: its FFN
    width, whether it has joint text-video blocks and its own guidance, for `check_model`). `strategy` None: ring
    on several cp ranks, none on one; `group_size` "node": the ranks of a node."""
    nodes, gpus_per_node = replica_shape(nodes, gpus_per_node, replicas)
    world = nodes * gpus_per_node
    cfg_degree = 2 if cfg_parallel else 1
    if cfg_degree == 2 and world % 2:
        raise ConfigError(f"--cfg-parallel needs an even number of ranks, got {world}")
    cp = world // cfg_degree
    strategy = strategy or (DEFAULT_CP if cp > 1 else "none")
    if isinstance(group_size, str):
        group_size = parse_group_size(group_size, gpus_per_node)
    layout = ParallelLayout(nodes, gpus_per_node, cfg_degree, strategy, ulysses_degree, group_size)
    layout = layout.with_defaults(heads)
    layout.check_model(heads, ffn, joint_text, own_guidance)
    return layout
