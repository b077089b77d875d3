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

import json
import os
import shlex
from dataclasses import asdict, dataclass

import torch

from basics.errors import ConfigError
from runtime.config import RunConfig
from runtime.models.loading import resolve_placement
from slurm.launchers.srun import allocation_gpus_per_node, srun_command
from slurm.options import SlurmOptions
from slurm.rank import device_intent, rank_environment


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
                rank=g,
                node=g // per_node,
                local_rank=local_rank,
                gpu=local_rank if cfg.device == "cuda" else None,
                replica=replica,
                replica_rank=r,
                cfg_index=cfg_index,
                cp_index=cp_index,
                ulysses_index=ulysses_index,
                ring_index=ring_index,
                group_index=cp_index // layout.group if "group_size" in layout.strategy.options else None,
            )
        )
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
    placement = resolve_placement(device)  # local, or a launcher's rank: this machine's GPUs
    if where == "env":  # one rank of the launcher's on this machine (slurm/rank.py select_device picks its GPU)
        return placement.device.type
    if placement.device.type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(
            f"{world} ranks need {world} GPUs on this machine, found "
            f"{torch.cuda.device_count()} (NCCL needs one GPU per rank); use fewer ranks or --device cpu"
        )
    return placement.device.type


# How to get a torch that computes on NVIDIA GPUs (docs/setup.md says more).
INSTALL_CUDA_TORCH = "./scripts/setup.sh --cuda (in the checkout), or pip install torch --index-url https://download.pytorch.org/whl/cu128"


def cpu_only_torch(device: str) -> str | None:
    """The problem, in one line, of ranks that are to compute on GPUs (`device` "cuda", the
    executor's decision) with this environment's torch when it is a CPU-only build: the jobs and
    steps run this very environment, so they would fail on the node after queueing. None when
    the build has CUDA (or ROCm), or the ranks compute on CPUs (--device cpu, DITANGO_RANK_DEVICE)."""
    if device != "cuda" or device_intent(device) == "cpu" or torch.version.cuda or torch.version.hip:
        return None
    return (
        f"this run computes on GPUs, but this environment's torch ({torch.__version__}) is a CPU-only build, "
        f"which the ranks would run; install a CUDA build: {INSTALL_CUDA_TORCH}; or run with --device cpu"
    )


def describe(cfg: RunConfig, opts: SlurmOptions, where: str) -> dict:
    """What a launch of `cfg` by `where` (local, srun, sbatch) would be, as JSON-ready data: the
    executor and its shape (nodes, tasks per node, GPUs requested), the sbatch script submitit
    would submit or the srun command of each array task, the environment every rank gets, and
    every rank's place (PYTHONPATH: the folder put before the rank's own PYTHONPATH). What
    `generate --dry-run` prints."""
    from slurm.launchers.sbatch import absolute_paths, sbatch_script, submission_config, submission_folder

    if where == "sbatch":
        cfg = submission_config(cfg)
    elif where == "srun":
        cfg = absolute_paths(cfg)
    gpus = cfg.gpus_per_node if cfg.device == "cuda" and where != "local" else 0
    record: dict = {
        "dry_run": True,
        "executor": where,
        "nodes": cfg.nodes,
        "tasks_per_node": cfg.gpus_per_node,
        "gpus_per_node_requested": gpus,
        "device": cfg.device,
        "backend": "nccl" if cfg.device == "cuda" else "gloo",
        "replicas": cfg.replicas,
        "layout": cfg.layout.to_json(),
        "layout_choice": cfg.layout_choice,  # --layout auto: the search's choice and why
        "timeouts_s": {"step": cfg.timeout_s, "setup": cfg.setup_timeout_s},
        "attention": cfg.attention_backend,  # as asked: a rank resolves auto for its own GPU
        "compile": cfg.compile,
        "quantize": cfg.quantize,
        "items": len(cfg.items),
        "item_list": [item.to_json() for item in cfg.items],  # sizes and steps as the run would make them
        "ditango": None if cfg.ditango is None else json.loads(json.dumps(asdict(cfg.ditango), default=str)),
        "array": opts.array,
        "queue": {"mode": cfg.queue.mode, "lease_s": cfg.queue.lease_s},
        "environment": rank_environment(cfg.out_dir),
        "ranks": [s.to_json() for s in rank_slots(cfg, local=where == "local")],
    }
    if where == "env":
        record["executor_line"] = (
            f"env: this process is one of {cfg.world_size} rank(s) its launcher started ({cfg.nodes} node(s) of "
            f"{cfg.gpus_per_node}); rank 0 writes" + ("; one GPU per rank" if cfg.device == "cuda" else "")
        )
    elif where == "local":
        record["executor_line"] = (
            f"local, {cfg.world_size} process(es) on this machine ({cfg.nodes} virtual node(s) of "
            f"{cfg.gpus_per_node})" + ("; one GPU per rank" if cfg.device == "cuda" else "")
        )
    else:
        kind = "sbatch (a new Slurm job)" if where == "sbatch" else "srun (steps of the current allocation)"
        request = f"{gpus} GPU(s) per node requested" if gpus else "no GPUs requested"
        record["executor_line"] = (
            f"{kind}; {cfg.nodes} node(s) x {cfg.gpus_per_node} task(s), one rank per task; {request}"
        )
    if where == "sbatch":
        folder = submission_folder(cfg)
        record["folder"] = str(folder)
        record["sbatch_script"] = sbatch_script(cfg, opts, folder, opts.array)
        record["environment"] = {**record["environment"], "PYTHONPATH": str(folder / "code")}
    elif where == "srun":
        folder = cfg.out_dir / "slurm" / "srun-<stamp>"
        record["srun_commands"] = [
            shlex.join(srun_command(cfg, folder, t, folder / f"call-{t}.pkl")) for t in range(opts.array)
        ]
        record["environment"] = {**record["environment"], "PYTHONPATH": str(folder / "code")}
    return record
