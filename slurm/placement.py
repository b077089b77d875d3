"""Where every rank of a run lands: its device type, node, local rank and GPU, replica and
layout coordinates.

A pure function of the config, the same arithmetic the launchers use: Slurm places a job's
`--ntasks-per-node` tasks block by block (task g on node g // tasks per node, local rank
g % tasks per node); the local launcher runs every rank on this machine (local rank g) and
puts it on virtual node g // GPUs per node; each rank computes on the GPU of its local rank
(slurm/rank.py); replica r holds the global ranks [r * W, (r + 1) * W) of a W-rank layout
(runtime/mesh.py orders them).
`ditango generate --dry-run` prints this table.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from runtime.config import RunConfig
from runtime.errors import ConfigError
from runtime.models.loading import resolve_placement
from slurm.allocation import allocation_gpus_per_node


@dataclass(frozen=True)
class RankSlot:
    rank: int  # in the allocation (all replicas)
    node: int
    local_rank: int  # on its node
    gpu: int | None  # the local GPU it computes on; None on CPU
    replica: int
    replica_rank: int  # its rank in the replica's process group
    cfg_index: int  # 0: unconditional branch, 1: conditional (cfg degree 2)
    cp_index: int
    ulysses_index: int
    ring_index: int
    group_index: int | None  # DiTango group; None for other strategies

    def to_json(self) -> dict:
        return asdict(self)


def rank_slots(cfg: RunConfig, local: bool = False) -> list[RankSlot]:
    """`local`: the local launcher (all ranks on this machine) rather than Slurm tasks."""
    layout = cfg.layout
    size, per_node = layout.world_size, cfg.gpus_per_node
    slots = []
    for g in range(cfg.world_size):
        local_rank = g if local else g % per_node
        replica, r = divmod(g, size)
        cfg_index, cp_index = divmod(r, layout.cp_degree)
        ring_index, ulysses_index = divmod(cp_index, layout.ulysses)
        slots.append(
            RankSlot(
                rank=g, node=g // per_node, local_rank=local_rank,
                gpu=local_rank if cfg.device == "cuda" else None,
                replica=replica, replica_rank=r, cfg_index=cfg_index, cp_index=cp_index,
                ulysses_index=ulysses_index, ring_index=ring_index,
                group_index=cp_index // layout.group if layout.strategy == "ditango" else None,
            )
        )  # fmt: skip
    return slots


def ranks_device(where: str, device: str, world: int, gpus_per_node: int) -> str:
    """The device type the ranks will compute on ("cpu" or "cuda"), checked against what the
    executor has. A submission (sbatch) asks Slurm for GPUs unless --device cpu: this machine
    (a login node, or a GPU node with fewer GPUs than the job) says nothing about the compute
    nodes, which check for themselves when the job starts. Inside an allocation (srun) the
    allocation's GPUs count; locally, this machine's."""
    if device == "cpu":
        return "cpu"
    if where == "sbatch":
        return "cuda"
    if where == "srun":
        have = allocation_gpus_per_node()
        if have is None:  # Slurm says nothing (no GPU request); a batch script sees its node's GPUs
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            if device == "cuda":
                raise ConfigError(
                    f"--device cuda: allocation {os.environ.get('SLURM_JOB_ID')} has no GPUs; "
                    "allocate with --gpus-per-node N, or use --device cpu"
                )
            return "cpu"
        if gpus_per_node > have:
            raise ConfigError(
                f"--gpus-per-node {gpus_per_node} needs {gpus_per_node} GPUs per node, but allocation "
                f"{os.environ.get('SLURM_JOB_ID')} has {have}; use --gpus-per-node <= {have}, or --device cpu"
            )
        return "cuda"
    placement = resolve_placement(device)  # local: this machine's GPUs
    if placement.device.type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(
            f"{world} ranks need {world} GPUs on this machine, found "
            f"{torch.cuda.device_count()} (NCCL needs one GPU per rank); use fewer ranks or --device cpu"
        )
    return placement.device.type
