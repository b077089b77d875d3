"""Inside an existing allocation (`salloc`, or the user's own batch script): ranks via `srun`.

Each array task becomes one job step, `srun --nodes N --ntasks-per-node G`, run one after
the other inside the allocation (as `--array` does locally). A step runs the same
`SlurmRun` call as a submitted job, on a snapshot of the code; the call travels as a
pickle file in the output folder, never as a shell line, so prompts never reach a shell.

    python -m slurm.allocation CALL.pkl   (what each srun task runs)
"""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from runtime.config import RunConfig
from slurm.aggregate import aggregate
from slurm.options import SlurmOptions
from slurm.rank import exit_soon, is_peer_failure
from slurm.supervise import Outcome


def run_steps(
    cfg: RunConfig,
    opts: SlurmOptions,
    decided: dict,
    on_state: Callable | None = None,
    poll_s: float = 2.0,
    tasks: list[int] | None = None,
) -> list[tuple[str | None, int | None]]:
    """Run array tasks (default all) as srun steps of the current allocation, one after the
    other; each step's (error, failing rank), error None when it succeeded."""
    from slurm.submit import absolute_paths, snapshot_code

    cfg = absolute_paths(cfg)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    folder = (cfg.out_dir / "slurm" / f"srun-{stamp}").resolve()
    code = snapshot_code(folder / "code")
    env = {
        **os.environ,
        "PYTHONPATH": f"{code}:{os.environ.get('PYTHONPATH', '')}",
        "SUBMITIT_EXECUTOR": "slurm",  # submitit's Slurm job environment reads the rank variables
    }
    errors: list[tuple[str | None, int | None]] = []
    for task in range(opts.array) if tasks is None else tasks:
        call = folder / f"call-{task}.pkl"
        with open(call, "wb") as f:
            pickle.dump((cfg, task, opts.array, decided), f)
        cmd = srun_command(cfg, folder, task, call)
        proc = subprocess.Popen(cmd, env=env, cwd=code, stdin=subprocess.DEVNULL)
        while proc.poll() is None:
            if on_state is not None:
                on_state([f"srun step {task + 1}/{opts.array} RUNNING"])
            time.sleep(poll_s)
        errors.append((None, None) if proc.returncode == 0 else _step_error(folder, task, proc.returncode))
    return errors


class SrunExecutor:
    """Array tasks as srun steps of the current allocation, one after the other."""

    def __init__(self, cfg: RunConfig, opts: SlurmOptions, on_state: Callable | None = None, say=print) -> None:
        self.cfg, self.opts, self.on_state, self.say = cfg, opts, on_state, say

    def launch(self, tasks: list[int], decided: dict[str, dict]) -> list[Outcome]:
        self.say(f"executor: srun in allocation {os.environ.get('SLURM_JOB_ID')}")
        failures = run_steps(self.cfg, self.opts, decided, self.on_state, tasks=tasks)
        return [Outcome(t, error, rank, f"step {t}") for t, (error, rank) in zip(tasks, failures, strict=True)]

    def report(self) -> dict:
        return aggregate(self.cfg.out_dir)


def srun_command(cfg: RunConfig, folder: Path, task: int, call: Path) -> list[str]:
    """The job step of one array task: a task per rank, each on its own GPU when the run
    computes on GPUs; `--kill-on-bad-exit` ends the step when one rank fails (its NCCL peers
    would otherwise wait in their collectives until the watchdog)."""
    gpus = [f"--gpus-per-node={cfg.gpus_per_node}"] if cfg.device == "cuda" else []
    return [
        "srun", f"--nodes={cfg.nodes}", f"--ntasks-per-node={cfg.gpus_per_node}", *gpus,
        "--kill-on-bad-exit=1", f"--output={folder}/task-{task}-rank-%t.log",
        sys.executable, "-m", "slurm.allocation", str(call),
    ]  # fmt: skip


def allocation_gpus_per_node() -> int | None:
    """GPUs per node of the current allocation, from what Slurm sets (None: it says nothing,
    e.g. no GPU was requested). SLURM_GPUS_ON_NODE (batch script and steps), else the request
    as salloc passes it on (SLURM_GPUS_PER_NODE, e.g. "8" or "h100:8"), else SLURM_JOB_GPUS
    (the GPU indices of this node)."""
    on_node = os.environ.get("SLURM_GPUS_ON_NODE")
    if on_node and on_node.strip().isdigit():
        return int(on_node)
    per_node = os.environ.get("SLURM_GPUS_PER_NODE")
    if per_node:
        count = per_node.split(",")[0].split(":")[-1].split("(")[0]
        if count.isdigit():
            return int(count)
    ids = os.environ.get("SLURM_JOB_GPUS")
    if ids:
        return len([i for i in ids.split(",") if i.strip()])
    return None


def _step_error(folder: Path, task: int, returncode: int) -> tuple[str, int | None]:
    """(error, rank) of the rank of this step that raised first (not a peer it took down)."""
    found = sorted(folder.glob(f"task-{task}-rank-*.error"), key=lambda p: p.stat().st_mtime)
    errors = [(p.read_text(encoding="utf-8").strip(), int(p.name.split("-rank-")[1].split(".")[0])) for p in found]
    own = [e for e in errors if not is_peer_failure(e[0])]
    if errors:
        return (own or errors)[0]
    return f"srun exited with code {returncode} (logs: {folder}/task-{task}-rank-*.log)", None


def _step_environment() -> None:
    """Describe the step, not the whole allocation, to submitit (it reads the SLURM_JOB_* names),
    and give each step its own rendezvous port."""
    for job_name, step_name in (
        ("SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"),
        ("SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES"),
        ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"),
    ):
        if os.environ.get(step_name):
            os.environ[job_name] = os.environ[step_name]
    seed = f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}"
    os.environ.setdefault("MASTER_PORT", str(random.Random(seed).randint(20000, 60000)))


def main(call: Path) -> None:
    from slurm.submit import SlurmRun

    with open(call, "rb") as f:
        cfg, task, tasks, decided = pickle.load(f)  # written by run_steps for this step
    _step_environment()
    try:
        SlurmRun()(cfg, task, tasks, decided)
    except BaseException as exc:
        exit_soon()  # SlurmRun armed it already, unless it failed before that
        rank = os.environ.get("SLURM_PROCID", "0")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        (call.parent / f"task-{task}-rank-{rank}.error").write_text(f"rank {rank}: {type(exc).__name__}: {first}\n")
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]))
