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

from planner.errors import ConfigError
from runtime.config import RunConfig

Executor = Literal["auto", "local", "slurm"]
_KEY = re.compile(r"[a-z][a-z0-9_-]*")


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    extra: tuple[tuple[str, str], ...] = ()  # --slurm-arg KEY=VALUE, in order
    job_name: str = "ditango"
    array: int = 1
    array_parallelism: int | None = None

    def __post_init__(self) -> None:
        if self.time_min < 1:
            raise ConfigError(f"--time must be >= 1 minute, got {self.time_min}")
        if self.array < 1:
            raise ConfigError(f"--array must be >= 1, got {self.array}")
        if self.array_parallelism is not None and self.array_parallelism < 1:
            raise ConfigError(f"--array-parallelism must be >= 1, got {self.array_parallelism}")
        for key, _ in self.extra:
            if not _KEY.fullmatch(key):
                raise ConfigError(f"--slurm-arg {key!r}: expected KEY=VALUE with a sbatch option name as KEY")
        # Values become `#SBATCH` lines, shell-quoted (submitit), which sbatch reads with its own
        # parser: a newline would end the line there (and a shell command could follow it), and
        # the parser takes a backslash as an escape even inside quotes, so the value would change.
        named = {"--partition": self.partition, "--account": self.account, "--qos": self.qos, "--mem": self.mem,
                 "--constraint": self.constraint, **{f"--slurm-arg {k}": v for k, v in self.extra}}  # fmt: skip
        for flag, value in named.items():
            if value is not None and any(ord(c) < 32 or ord(c) == 127 or c == "\\" for c in value):
                raise ConfigError(
                    f"{flag} {value!r}: control characters (a newline, a tab) and backslashes cannot reach sbatch"
                )

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
        keys = ("partition", "account", "qos", "cpus_per_task", "mem", "constraint", "extra")
        return any(getattr(self, k) != getattr(defaults, k) for k in keys) or self.array > 1


def check_log_folder(out: Path) -> None:
    """Refuse an output folder Slurm cannot carry: the job's logs (`--output`, `--error`) lie
    under it, and Slurm reads `%` in those paths as a pattern (`%j`: the job id) and a
    backslash as turning the patterns off, and a control character would end a `#SBATCH`
    line. Any other character is passed quoted (slurm/submit.py)."""
    path = str(out.expanduser().resolve())
    bad = sorted({c for c in path if c in "%\\" or ord(c) < 32 or ord(c) == 127})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise ConfigError(
            f"--out {path!r}: Slurm cannot carry {shown} in the path of its logs; choose a folder without "
            "them, or run with --executor local"
        )


def submitit_parameters(cfg: RunConfig, opts: SlurmOptions, use_gpus: bool) -> dict:
    """`SlurmExecutor.update_parameters(**this)` for one multi-node job (or array task)."""
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
    }
    if use_gpus:  # one GPU per task; each task picks its own by SLURM_LOCALID
        params["gpus_per_node"] = cfg.gpus_per_node
    optional = {
        "partition": opts.partition, "account": opts.account, "qos": opts.qos, "mem": opts.mem,
        "constraint": opts.constraint, "cpus_per_task": opts.cpus_per_task,
        "array_parallelism": opts.array_parallelism,
    }  # fmt: skip
    params.update({k: v for k, v in optional.items() if v is not None})
    if opts.extra:
        params["additional_parameters"] = {k.replace("-", "_"): v for k, v in opts.extra}
    return params


def choose_executor(
    requested: Executor, layout_nodes: int, opts: SlurmOptions, require_sbatch: bool = True, ranks: int | None = None
) -> Literal["local", "srun", "sbatch"]:
    """`auto`: inside an allocation (SLURM_JOB_ID) start ranks with srun there, except one rank
    (`ranks`) on a node of the allocation itself (an `srun --pty` shell, a batch script:
    SLURMD_NODENAME is set), which runs in this process; else submit with sbatch when it is on
    PATH and the run needs more than one node or any Slurm option was given; else run locally.
    `require_sbatch` False (a dry run): `slurm` means sbatch even where sbatch is not installed."""
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
