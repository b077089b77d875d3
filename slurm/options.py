"""Slurm submission options -> submitit parameters (a pure function, locked by a golden file).

No prompt text ever reaches a shell: the job runs a pickled Python callable (submitit),
and only these scheduler options are rendered into the sbatch script.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from basics.errors import ConfigError
from basics.user_files import user_path
from planner.host_memory import CPUS_PER_RANK, mem_request
from runtime.config import RunConfig
from slurm.rank import LAUNCHER_VARIABLES, launched_rank

Executor = Literal["auto", "local", "slurm", "env"]
_KEY = re.compile(r"[a-z][a-z0-9_-]*")
_MEM = re.compile(r"[0-9]+[KMGT]?")  # sbatch --mem: a number of megabytes, or with a unit
# sbatch options the tool sets itself: given again through --slurm-arg they would move its logs
# out of --out or break the one-task-per-rank layout.
_OWN = {
    **dict.fromkeys(("output", "error", "chdir", "open-mode"),
                    "ditango sets it (the job's logs and files stay under --out)"),
    **dict.fromkeys(("nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "gpus", "signal"),
                    "ditango sets it from --nodes and --gpus-per-node (one task per rank)"),
    # (--exclusive is a switch; `--slurm-arg exclusive=user` is sbatch's other forms of it)
    **{k: f"use --{k}" for k in ("time", "partition", "account", "qos", "mem", "constraint", "cpus-per-task", "array")},
}  # fmt: skip


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60
    cpus_per_task: int | None = None
    mem: str | None = None  # None: the run's host memory per node (planner/host_memory.py)
    constraint: str | None = None
    exclusive: bool = False  # sbatch --exclusive: whole nodes
    extra: tuple[tuple[str, str], ...] = ()  # --slurm-arg KEY=VALUE, in order
    job_name: str = "ditango"
    array: int = 1
    array_parallelism: int | None = None

    def __post_init__(self) -> None:
        if self.time_min < 1:
            raise ConfigError(f"--time must be >= 1 minute, got {self.time_min}")
        if self.array < 1:
            raise ConfigError(f"--array must be >= 1, got {self.array}")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(f"--cpus-per-task must be >= 1, got {self.cpus_per_task}")
        if self.array_parallelism is not None and self.array_parallelism < 1:
            raise ConfigError(f"--array-parallelism must be >= 1, got {self.array_parallelism}")
        for key, _ in self.extra:
            if not _KEY.fullmatch(key):
                raise ConfigError(f"--slurm-arg {key!r}: expected KEY=VALUE with a sbatch option name as KEY")
        # Values become `#SBATCH` lines, shell-quoted (submitit), which sbatch reads with its own
        # parser: a newline would end the line there (and a shell command could follow it), and
        # the parser takes a backslash as an escape even inside quotes, so the value would change.
        named = {
            "--partition": self.partition,
            "--account": self.account,
            "--qos": self.qos,
            "--mem": self.mem,
            "--constraint": self.constraint,
            **{f"--slurm-arg {k}": v for k, v in self.extra},
        }
        for flag, value in named.items():
            if value is not None and any(ord(c) < 32 or ord(c) == 127 or c == "\\" for c in value):
                raise ConfigError(
                    f"{flag} {value!r}: control characters (a newline, a tab) and backslashes cannot reach sbatch"
                )
            if value is not None and not value.strip() and not flag.startswith("--slurm-arg"):
                raise ConfigError(f"{flag} is empty; leave it out for the cluster's default")
        if self.mem is not None and not _MEM.fullmatch(self.mem):
            raise ConfigError(f"--mem {self.mem!r}: sbatch takes a size such as 200G, 512000M or 0 (all of a node's)")
        for key, _ in self.extra:
            if key in _OWN:
                raise ConfigError(f"--slurm-arg {key}: {_OWN[key]}")

    @classmethod
    def parse_extra(cls, pairs: list[str]) -> tuple[tuple[str, str], ...]:
        out = []
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ConfigError(f"--slurm-arg {pair!r}: expected KEY=VALUE (e.g. --slurm-arg exclusive=user)")
            out.append((key.strip().lstrip("-").replace("_", "-"), value))
        return tuple(out)

    @property
    def any_given(self) -> bool:
        """Whether the user asked for anything Slurm-specific (makes `auto` submit)."""
        defaults = SlurmOptions()
        keys = ("partition", "account", "qos", "cpus_per_task", "mem", "constraint", "exclusive", "extra")
        return any(getattr(self, k) != getattr(defaults, k) for k in keys) or self.array > 1


def check_log_folder(out: Path) -> None:
    """Refuse an output folder Slurm cannot carry: the job's logs (`--output`, `--error`) lie
    under it, and Slurm reads `%` in those paths as a pattern (`%j`: the job id) and a
    backslash as turning the patterns off, and a control character would end a `#SBATCH`
    line. Any other character is passed quoted (slurm/launchers/sbatch.py)."""
    path = str(user_path(out, "--out", resolve=True))
    bad = sorted({c for c in path if c in "%\\" or ord(c) < 32 or ord(c) == 127})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise ConfigError(
            f"--out {path!r}: Slurm cannot carry {shown} in the path of its logs; choose a folder without "
            "them, or run with --executor local"
        )


@dataclass(frozen=True)
class NodeSize:
    """The smallest node of the partition a job goes to, as sinfo tells (slurm/jobs.py
    `partition_nodes`): its CPUs and its memory in MiB (Slurm's RealMemory)."""

    cpus: int
    mem_mib: int


def host_request(cfg: RunConfig, opts: SlurmOptions, node: NodeSize | None = None) -> tuple[int, str | None, str]:
    """(CPUs per task, memory per node or None, a note: "" or why a request was cut) of a job
    of `cfg`. Unless the user gave them: CPUs per task `CPUS_PER_RANK`, and memory per node the
    host bytes the run recorded (`cfg.host_memory`, planner/host_memory.py) in whole GiB; neither
    is left to the cluster's default (often one CPU and a few GiB per task, which a 14B model's
    load outgrows). Where `node` is known, neither asks for more than it has: sbatch refuses a
    job no node can hold. A --constraint picks nodes the partition's smallest may not be: then
    nothing is cut."""
    if opts.constraint:
        node = None
    cpus, note = opts.cpus_per_task, []
    if cpus is None:
        cpus = CPUS_PER_RANK if node is None else max(1, min(CPUS_PER_RANK, node.cpus // cfg.gpus_per_node))
    mem = opts.mem
    if mem is None and cfg.host_memory is not None:
        mem = mem_request(cfg.host_memory)
        if node is not None and node.mem_mib > 0 and int(mem.removesuffix("G")) * 1024 > node.mem_mib:  # as asked
            note.append(
                f"the run needs about {mem} of host memory per node, the partition's smallest nodes have "
                f"{node.mem_mib}M: asking for that (--mem overrides)"
            )
            mem = f"{node.mem_mib}M"
    return cpus, mem, "; ".join(note)


def submitit_parameters(cfg: RunConfig, opts: SlurmOptions, use_gpus: bool, node: NodeSize | None = None) -> dict:
    """`SlurmExecutor.update_parameters(**this)` for one multi-node job (or array task); the
    CPUs and memory are `host_request`'s (`node`: the partition's smallest, when known)."""
    params: dict = {
        "job_name": opts.job_name,
        "nodes": cfg.nodes,  # the whole allocation: every replica
        "ntasks_per_node": cfg.gpus_per_node,  # one task per rank
        "time": opts.time_min,
        # Warning before the time limit (checkpoint + requeue): 2 minutes, or a quarter of short limits.
        "signal_delay_s": min(120, opts.time_min * 15),
        # One failing rank ends the step at once: under NCCL its peers would otherwise spin in
        # their collectives until the watchdog's timeout (slurm/rank.py).
        "srun_args": ["--kill-on-bad-exit=1"],
        # No --wckey unless asked (--slurm-arg wckey=KEY): submitit's own default, "submitit", is
        # refused by clusters that enforce workload characterization keys.
        "wckey": None,
    }
    if use_gpus:  # one GPU per task; each task picks its own by SLURM_LOCALID
        params["gpus_per_node"] = cfg.gpus_per_node
    cpus, mem, _ = host_request(cfg, opts, node)
    optional = {
        "partition": opts.partition,
        "account": opts.account,
        "qos": opts.qos,
        "mem": mem,
        "constraint": opts.constraint,
        "cpus_per_task": cpus,
        "array_parallelism": opts.array_parallelism,
        "exclusive": opts.exclusive or None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    if opts.extra:
        params["additional_parameters"] = {k.replace("-", "_"): v for k, v in opts.extra}
    return params


def choose_executor(
    requested: Executor, layout_nodes: int, opts: SlurmOptions, require_sbatch: bool = True, ranks: int | None = None
) -> Literal["local", "srun", "sbatch", "env"]:
    """`auto`: where a launcher started this process as one rank of several (torchrun,
    Kubernetes, MPI: slurm/rank.py LAUNCHER_VARIABLES), run as that rank (`env`); inside an
    allocation (SLURM_JOB_ID) start ranks with srun there, except one rank
    (`ranks`) on a node of the allocation itself (an `srun --pty` shell, a batch script:
    SLURMD_NODENAME is set), which runs in this process; else submit with sbatch when it is on
    PATH and the run needs more than one node or any Slurm option was given; else run locally.
    `require_sbatch` False (a dry run): `slurm` means sbatch even where sbatch is not installed."""
    launched = None if requested in ("local", "slurm") else launched_rank()  # asked for: a launcher's vars are not read
    if requested == "env":
        if launched is None:
            missing = ", ".join(v for v in LAUNCHER_VARIABLES if not os.environ.get(v))
            raise ConfigError(
                f"--executor env: no launcher started this process ({missing} not set); start it with "
                "torchrun (or a Kubernetes PyTorchJob), or use --executor local or slurm"
            )
        return "env"
    if requested == "auto" and launched is not None:
        return "env"
    in_allocation = bool(os.environ.get("SLURM_JOB_ID"))
    if requested == "auto" and in_allocation and ranks == 1 and os.environ.get("SLURMD_NODENAME"):
        return "local"  # a nested step would wait for the resources this shell's own step holds
    have_sbatch = shutil.which("sbatch") is not None
    if requested == "local":
        return "local"
    if requested == "slurm":
        if in_allocation:
            return "srun"
        if not have_sbatch and require_sbatch:
            raise ConfigError("--executor slurm: sbatch is not on PATH (is this a Slurm login node?)")
        return "sbatch"
    if in_allocation:
        return "srun"
    if have_sbatch and (layout_nodes > 1 or opts.any_given):
        return "sbatch"
    return "local"
