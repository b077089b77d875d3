"""Parallel layout (user intent) -> process groups and the node map.

Global rank order: rank = cfg_index * cp_degree + cp_index. Inside the cp axis, USP
puts Ulysses innermost (cp_index = ring_index * ulysses_degree + ulysses_index), so
a Ulysses group is a run of adjacent ranks, which share a node whenever
ulysses_degree divides the GPUs per node. Groups are passed explicitly; nothing here
is a module-level global. Besides the layout's groups every rank has a world group for
per-step collectives (the step timeout) and a gloo control group for object messages and
the waits on the writer (the setup timeout); `build_mesh` uses every communicator once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from runtime.errors import ConfigError

Strategy = Literal["none", "ring", "ulysses", "usp", "ditango"]
STRATEGIES = ("none", "ring", "ulysses", "usp", "ditango")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """How the world is split. world = nodes x gpus_per_node = cfg_degree x cp_degree."""

    nodes: int = 1
    gpus_per_node: int = 1
    cfg_degree: int = 1
    strategy: Strategy = "none"
    ulysses_degree: int | None = None  # usp only; None: the largest legal degree within a node
    group_size: int | None = None  # ditango only: adjacent cp ranks per group; None: 2 (1 if odd)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} and {self.gpus_per_node}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--parallel must be one of {', '.join(STRATEGIES[1:])}, got {self.strategy!r}")
        if self.cfg_degree not in (1, 2) or self.world_size % self.cfg_degree:
            raise ConfigError(f"cfg degree must be 1 or 2 and divide the world size {self.world_size}")
        if self.strategy == "none" and self.cp_degree > 1:
            raise ConfigError(
                f"{self.world_size} ranks need a context-parallel strategy: add --parallel ring, ulysses or usp"
            )
        if self.ulysses_degree is not None:
            if self.strategy != "usp":
                raise ConfigError("--ulysses-degree only applies to --parallel usp")
            if self.ulysses_degree < 1 or self.cp_degree % self.ulysses_degree:
                legal = ", ".join(map(str, _divisors(self.cp_degree)))
                raise ConfigError(
                    f"--ulysses-degree {self.ulysses_degree} must divide the cp degree {self.cp_degree} (try {legal})"
                )

        if self.group_size is not None:
            if self.strategy != "ditango":
                raise ConfigError("--group-size only applies to --parallel ditango")
            if self.group_size < 1 or self.cp_degree % self.group_size:
                legal = ", ".join(map(str, _divisors(self.cp_degree)))
                raise ConfigError(
                    f"--group-size {self.group_size} must divide the cp degree {self.cp_degree} (try {legal})"
                )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def group(self) -> int:
        """DiTango group size: adjacent cp ranks whose KV is always computed fresh together."""
        if self.strategy != "ditango":
            return 1
        if self.group_size is not None:
            return self.group_size
        return 2 if self.cp_degree % 2 == 0 else 1

    @property
    def groups(self) -> int:
        return self.cp_degree // self.group

    @property
    def cp_degree(self) -> int:
        return self.world_size // self.cfg_degree

    @property
    def ulysses(self) -> int:
        """Ulysses (head all-to-all) degree inside the cp axis."""
        if self.strategy == "ulysses":
            return self.cp_degree
        if self.strategy == "usp":
            return self.ulysses_degree or 1
        return 1

    @property
    def ring(self) -> int:
        return self.cp_degree // self.ulysses

    def check_model(self, heads: int) -> None:
        """Errors that depend on the model: Ulysses splits heads, so its degree must divide them."""
        if self.ulysses > 1 and heads % self.ulysses:
            best = max(d for d in _divisors(self.cp_degree) if heads % d == 0)
            hint = "use --parallel ring" + (f", or --parallel usp --ulysses-degree {best}" if best > 1 else "")
            raise ConfigError(f"Ulysses degree {self.ulysses} must divide the model's {heads} attention heads; {hint}")

    def with_default_ulysses(self, heads: int) -> ParallelLayout:
        """USP without --ulysses-degree: the largest degree dividing heads that stays inside a node."""
        if self.strategy != "usp" or self.ulysses_degree is not None:
            return self
        per_node = self.cp_degree if self.nodes == 1 else self.gpus_per_node
        best = max(d for d in _divisors(self.cp_degree) if heads % d == 0 and per_node % d == 0)
        return ParallelLayout(self.nodes, self.gpus_per_node, self.cfg_degree, self.strategy, best, self.group_size)

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "cfg_degree": self.cfg_degree,
            "cp_degree": self.cp_degree,
            "strategy": self.strategy,
            "ulysses_degree": self.ulysses,
            "ring_degree": self.ring,
            "group_size": self.group,
        }


@dataclass
class Mesh:
    """This rank's view of the layout: its groups (global rank lists) and the node map."""

    layout: ParallelLayout
    rank: int
    node_of: tuple[int, ...]  # node index of every global rank
    cp_ranks: tuple[int, ...]
    ulysses_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]
    group_ranks: tuple[int, ...]  # DiTango group (adjacent cp ranks); (rank,) for other strategies
    cfg_ranks: tuple[int, ...]  # the ranks holding this cp index in each cfg group (CFG partners)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Per-step collectives (the step timeout): every rank of the replica.
    world_group: object = None
    # Control plane (gloo on CPU, the setup timeout): object gathers and the waits on the
    # writer (rank 0 decoding and writing while the others wait). Never on the GPU.
    control_group: object = None
    cp_group: object = None
    ulysses_group: object = None
    ring_group: object = None
    group_group: object = None
    cfg_group: object = None
    groups: dict = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def cp_index(self) -> int:
        return self.cp_ranks.index(self.rank)

    @property
    def cfg_index(self) -> int:
        """0: the unconditional branch's rank group, 1: the conditional one (cfg degree 2)."""
        return self.rank // self.layout.cp_degree

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]

    def link(self, peer: int) -> Literal["intra_node", "inter_node"]:
        return "intra_node" if self.same_node(self.rank, peer) else "inter_node"


def rank_groups(layout: ParallelLayout) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every kind, as global rank tuples, in a fixed order (all ranks agree)."""
    cp, u = layout.cp_degree, layout.ulysses
    cp_groups = [tuple(range(c * cp, (c + 1) * cp)) for c in range(layout.cfg_degree)]
    ulysses_groups, ring_groups, ditango_groups = [], [], []
    for base in (g[0] for g in cp_groups):
        for g in range(layout.groups):
            ditango_groups.append(tuple(base + g * layout.group + j for j in range(layout.group)))
        for r in range(layout.ring):
            ulysses_groups.append(tuple(base + r * u + i for i in range(u)))
        for i in range(u):
            ring_groups.append(tuple(base + r * u + i for r in range(layout.ring)))
    cfg_groups = [tuple(c + i * cp for i in range(layout.cfg_degree)) for c in range(cp)]
    return {"cp": cp_groups, "ulysses": ulysses_groups, "ring": ring_groups, "group": ditango_groups, "cfg": cfg_groups}


def virtual_node_map(layout: ParallelLayout) -> tuple[int, ...]:
    """Local runs: rank r sits on virtual node r // gpus_per_node."""
    return tuple(r // layout.gpus_per_node for r in range(layout.world_size))


def build_mesh(
    layout: ParallelLayout,
    rank: int,
    node_of: tuple[int, ...],
    timeout_s: float | None = None,
    device: torch.device | None = None,
    control_timeout_s: float | None = None,
) -> Mesh:
    """Create the process groups (a collective call: every rank must call it identically).

    `timeout_s` bounds per-step collectives; `control_timeout_s` (default: the same) the
    control group's waits. Every communicator is created and used once here (`warm_up`),
    so none is created lazily inside a step while another one has work in flight (NCCL
    documents concurrent communicators as able to deadlock)."""
    groups = rank_groups(layout)
    mine: dict[str, tuple[int, ...]] = {}
    handles: dict[str, object] = {}
    distributed = dist.is_available() and dist.is_initialized()
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    everyone = [tuple(range(layout.world_size))]
    for kind, members in (*((k, groups[k]) for k in GROUP_KINDS), ("world", everyone)):
        for ranks in members:
            handle = dist.new_group(list(ranks), timeout=timeout) if distributed and len(ranks) > 1 else None
            if rank in ranks:
                mine[kind], handles[kind] = ranks, handle
    control = None
    if distributed and layout.world_size > 1:
        control_timeout = timeout if control_timeout_s is None else timedelta(seconds=control_timeout_s)
        control = dist.new_group(list(range(layout.world_size)), timeout=control_timeout, backend="gloo")
    mesh = Mesh(
        layout=layout,
        rank=rank,
        node_of=tuple(node_of),
        cp_ranks=mine["cp"],
        ulysses_ranks=mine["ulysses"],
        ring_ranks=mine["ring"],
        group_ranks=mine["group"],
        cfg_ranks=mine["cfg"],
        device=device or torch.device("cpu"),
        world_group=handles["world"],
        control_group=control,
        cp_group=handles["cp"],
        ulysses_group=handles["ulysses"],
        ring_group=handles["ring"],
        group_group=handles["group"],
        cfg_group=handles["cfg"],
    )
    warm_up(mesh)
    return mesh


GROUP_KINDS = ("cp", "ulysses", "ring", "group", "cfg")


def warm_up(mesh: Mesh) -> None:
    """One small all-reduce on each of this rank's groups, in a fixed order of kinds.

    Deadlock-free: every rank is in exactly one group of each kind and visits the kinds in
    the same order, so each group's members meet at the same call. Point-to-point traffic
    later goes through `batch_isend_irecv` (runtime/comm.py), which uses these same
    communicators, so no communicator is created after this."""
    if mesh.world_group is None:
        return
    probes = []
    for kind in (*GROUP_KINDS, "world"):
        group = getattr(mesh, f"{kind}_group")
        if group is not None:
            probe = torch.ones(1, device=mesh.device)
            dist.all_reduce(probe, group=group)
            probes.append((kind, probe, dist.get_world_size(group)))
    probe = torch.ones(1)
    dist.all_reduce(probe, group=mesh.control_group)
    probes.append(("control", probe, mesh.world_size))
    for kind, probe, size in probes:  # .item() waits for the device: every communicator is up
        assert probe.item() == size, f"warm-up on the {kind} group gave {probe.item()}, expected {size}"
