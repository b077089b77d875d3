"""A rank's context: its mesh and transport (`RankContext`), and what the runtime tells its
caller as it goes (`Observer`: the command draws progress from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.comm import Comm
from runtime.config import Item, RunConfig
from runtime.mesh import Mesh, build_mesh
from runtime.models.loading import resolve_placement


class Observer(Protocol):
    """What the runtime tells its caller (the CLI draws progress from it)."""

    def run_started(self, total: int) -> None: ...
    def item_started(self, item: Item) -> None: ...
    def step_done(self, step: int, steps: int) -> None: ...
    def phase(self, name: str) -> None: ...  # after the steps: "decode", then "write" (the writer)
    def item_finished(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...


class SilentObserver:
    def run_started(self, total: int) -> None: ...
    def item_started(self, item: Item) -> None: ...
    def step_done(self, step: int, steps: int) -> None: ...
    def phase(self, name: str) -> None: ...
    def item_finished(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...


@dataclass
class RankContext:
    """This rank's mesh and transport; a single process has a trivial one (no collectives)."""

    mesh: Mesh
    comm: Comm

    @classmethod
    def single(cls, cfg: RunConfig, device: torch.device | None = None) -> RankContext:
        """One process; `device` None: resolved from `cfg.device` (CUDA when asked or available)."""
        device = device or resolve_placement(cfg.device, cfg.dtype).device
        mesh = build_mesh(cfg.layout, 0, (0,), device=device)
        return cls(mesh, Comm(mesh))

    @property
    def device(self) -> torch.device:
        """This rank's device, chosen by its launcher (the local GPU of its global rank)."""
        return self.mesh.device

    @property
    def distributed(self) -> bool:
        return self.mesh.world_size > 1

    @property
    def is_writer(self) -> bool:
        return self.mesh.rank == 0

    # Object collectives go over the control group (gloo, setup timeout): they carry records,
    # not tensors, and the waits on the writer can last as long as a video's decode.
    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        return self.comm.gather_objects(obj, self.mesh.control_group, range(self.mesh.world_size))

    def from_writer(self, obj):
        if not self.distributed:
            return obj
        return self.comm.broadcast_object(obj, 0, self.mesh.control_group)
