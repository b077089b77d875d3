"""The rank program every launcher runs (local processes, srun steps, sbatch jobs), once its
process group is up: its replica's share of the items, its mesh, then `execute`."""

from __future__ import annotations

from dataclasses import replace

import torch

from runtime.comm import Comm
from runtime.config import RunConfig
from runtime.context import Observer, RankContext
from runtime.mesh import build_mesh
from runtime.resume import plan_resume
from runtime.run import execute
from slurm.faults import with_faults
from slurm.supervise import replica_share


def run_rank(
    cfg: RunConfig,
    rank: int,
    node_of: tuple,
    replica: int,
    report_name: str,
    observer: Observer,
    global_rank: int,
    device: torch.device,
    skipped: dict | None = None,
    decided: dict | None = None,
) -> dict | None:
    """Rank `rank` of replica `replica` (global rank `global_rank`); `node_of`: the node of each
    rank of the replica (the byte counters and DiTango's groups read it); `skipped`: the items
    already complete (None: the writer decides and tells the others); `decided`: the items
    earlier launches settled. The run report on the writer, None elsewhere and for a replica
    with nothing to do."""
    cfg, report_name = replica_share(cfg, replica, report_name)
    if cfg is None:
        return None
    cfg = replace(cfg, queue=replace(cfg.queue, launch=f"{cfg.queue.launch}/r{replica}"))  # whose leases
    mesh = build_mesh(
        cfg.layout, rank, tuple(node_of), timeout_s=cfg.timeout_s, device=device, control_timeout_s=cfg.setup_timeout_s
    )
    ctx = RankContext(mesh, Comm(mesh))
    if skipped is None:
        skipped = ctx.from_writer(plan_resume(cfg) if rank == 0 else None)
    mine = {i.id for i in cfg.items}
    skipped = {k: v for k, v in skipped.items() if k in mine}
    decided = {k: v for k, v in (decided or {}).items() if k in mine}
    return execute(cfg, with_faults(observer, global_rank), ctx, skipped, report_name=report_name, decided=decided)
