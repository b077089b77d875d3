"""A rank's process groups, built from the parallel layout (planner/layout.py).

Groups are passed explicitly; nothing here is a module-level global. Besides the layout's
groups every rank has a world group for per-step collectives (the step timeout) and a gloo
control group for object messages and the waits on the writer (the setup timeout);
`build_mesh` uses every communicator once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from planner.layout import ParallelLayout, rank_groups


@dataclass
class Mesh:
    """This rank's view of the layout: its groups (global rank lists) and the node map."""

    layout: ParallelLayout
    rank: int
    node_of: tuple[int, ...]  # node index of every global rank
    cp_ranks: tuple[int, ...]
    ulysses_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]
    near_ranks: tuple[int, ...]  # DiTango group: adjacent cp ranks, always fresh; (rank,) for other strategies
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
    near_group: object = None
    cfg_group: object = None

    # Derived once: the replica's ranks, this rank's index in its cp group and its CFG branch
    # group (0: the unconditional branch's, 1: the conditional one's, under cfg degree 2).
    world_size: int = field(init=False)
    cp_index: int = field(init=False)
    cfg_index: int = field(init=False)

    def __post_init__(self) -> None:
        self.world_size = self.layout.world_size
        self.cp_index = self.cp_ranks.index(self.rank)
        self.cfg_index = self.rank // self.layout.cp_degree

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]

    def link(self, peer: int) -> Literal["intra_node", "inter_node"]:
        return "intra_node" if self.same_node(self.rank, peer) else "inter_node"


def build_mesh(
    layout: ParallelLayout,
    rank: int,
    node_of: tuple[int, ...],
    timeout_s: float | None = None,
    device: torch.device | None = None,
    control_timeout_s: float | None = None,
    control_backend: str = "gloo",
) -> Mesh:
    """Create the process groups (a collective call: every rank must call it identically).

    `timeout_s` bounds per-step collectives; `control_timeout_s` (default: the same) the
    control group's waits. One communicator per distinct set of ranks: kinds with the same
    members (cp, ring and world for a ring without CFG) share it, since each NCCL communicator
    costs GPU memory (its buffers; NVLS ones can take GBs). Every communicator is created and
    used once here (`warm_up`), so none is created lazily inside a step while another one has
    work in flight (NCCL documents concurrent communicators as able to deadlock)."""
    groups = rank_groups(layout)
    mine: dict[str, tuple[int, ...]] = {}
    handles: dict[str, object] = {}
    made: dict[tuple[int, ...], object] = {}  # members -> the one communicator of that set
    distributed = dist.is_available() and dist.is_initialized()
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    everyone = [tuple(range(layout.world_size))]
    for kind, members in (*((k, groups[k]) for k in GROUP_KINDS), ("world", everyone)):
        for ranks in members:
            if distributed and len(ranks) > 1 and ranks not in made:  # every rank takes the same turns
                made[ranks] = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine[kind], handles[kind] = ranks, made.get(ranks)
    control = None
    if distributed and layout.world_size > 1:
        control_timeout = timeout if control_timeout_s is None else timedelta(seconds=control_timeout_s)
        control = dist.new_group(list(range(layout.world_size)), timeout=control_timeout, backend=control_backend)
    mesh = Mesh(
        layout=layout,
        rank=rank,
        node_of=tuple(node_of),
        cp_ranks=mine["cp"],
        ulysses_ranks=mine["ulysses"],
        ring_ranks=mine["ring"],
        near_ranks=mine["near"],
        cfg_ranks=mine["cfg"],
        device=device or torch.device("cpu"),
        world_group=handles["world"],
        control_group=control,
        cp_group=handles["cp"],
        ulysses_group=handles["ulysses"],
        ring_group=handles["ring"],
        near_group=handles["near"],
        cfg_group=handles["cfg"],
    )
    warm_up(mesh)
    return mesh


GROUP_KINDS = ("cp", "ulysses", "ring", "near", "cfg")


def warm_up(mesh: Mesh) -> None:
    """One small all-reduce on each of this rank's communicators, in a fixed order of kinds (a
    communicator two kinds share, once).

    Deadlock-free: every rank is in exactly one group of each kind and visits the kinds in
    the same order, so each group's members meet at the same call (and the members of a
    shared communicator all skip the same later kinds). Point-to-point traffic later goes
    through `batch_isend_irecv` (runtime/comm.py), which uses these same communicators, so
    no communicator is created after this."""
    if mesh.world_group is None:
        return
    probes, warmed = [], set()
    for kind in (*GROUP_KINDS, "world"):
        group = getattr(mesh, f"{kind}_group")
        if group is not None and id(group) not in warmed:
            warmed.add(id(group))
            probe = torch.ones(1, device=mesh.device)
            dist.all_reduce(probe, group=group)
            probes.append((kind, probe, dist.get_world_size(group)))
    probe = torch.ones(1)
    dist.all_reduce(probe, group=mesh.control_group)
    probes.append(("control", probe, dist.get_world_size(mesh.control_group)))
    if is_fake(probes[0][1]):
        return  # a rehearsal (runtime/rehearse/): the collectives ran, no values came back
    for kind, probe, size in probes:  # .item() waits for the device: every communicator is up
        assert probe.item() == size, f"warm-up on the {kind} group gave {probe.item()}, expected {size}"
