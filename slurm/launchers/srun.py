"""Inside an existing allocation (`salloc`, or the user's own batch script): ranks via `srun`.

Each array task becomes one job step, `srun --nodes N --ntasks-per-node G`, run one after
the other inside the allocation (as `--array` does locally). A step runs the same
`SlurmRun` call as a submitted job, on a snapshot of the code; the call travels as a
pickle file in the output folder, never as a shell line, so prompts never reach a shell.

    python -m slurm.launchers.srun CALL.pkl   (what each srun task runs)
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import digits
from runtime.config import RunConfig
from runtime.errors import is_peer_failure
from slurm.aggregate import aggregate
from slurm.heartbeat import BeatWatch, kill_step, stopped_failure
from slurm.job_errors import srun_task_ends
from slurm.jobs import run_slurm
from slurm.options import SlurmOptions
from slurm.rank import exit_soon, rendezvous_port
from slurm.supervise import Outcome, tasks_with_work


def run_steps(
    cfg: RunConfig,
    opts: SlurmOptions,
    decided: dict,
    on_state: Callable | None = None,
    poll_s: float = 2.0,
    tasks: list[int] | None = None,
    folder: list | None = None,
) -> list[tuple[str | None, int | None]]:
    """Run array tasks (default all) as srun steps of the current allocation, one after the
    other; each step's (error, failing rank), error None when it succeeded. A step srun does not
    start at all (more nodes than the allocation has, say) is a ConfigError with srun's own
    message; its folder goes when no step ran before it."""
    from slurm.jobs import discard_folder, slurm_message
    from slurm.launchers.sbatch import absolute_paths, snapshot_code

    cfg = absolute_paths(cfg)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    steps = (cfg.out_dir / "slurm" / f"srun-{stamp}").resolve()
    if folder is not None:  # the caller learns where the steps ran (their launch keys)
        folder.append(steps)
    folder = steps
    try:
        code = snapshot_code(folder / "code")
    except OSError as exc:
        discard_folder(folder)
        raise ConfigError(f"cannot prepare the srun steps in {folder}: {exc.strerror or exc}") from None
    env = {
        **os.environ,
        "PYTHONPATH": ":".join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p),
        "SUBMITIT_EXECUTOR": "slurm",  # submitit's Slurm job environment reads the rank variables
    }
    errors: list[tuple[str | None, int | None]] = []
    for task in range(opts.array) if tasks is None else tasks:
        call = folder / f"call-{task}.pkl"
        step = replace(cfg, queue=replace(cfg.queue, launch=step_launch(folder, task)))  # its workers' leases
        with open(call, "wb") as f:
            pickle.dump((step, task, opts.array, decided), f)
        cmd = srun_command(cfg, folder, task, call)
        # srun's own messages, apart from the ranks' output: the reason it refused a step.
        srun_log = folder / f"task-{task}-srun.log"
        try:
            with open(srun_log, "wb") as log:
                proc = subprocess.Popen(cmd, env=env, cwd=code, stdin=subprocess.DEVNULL, stderr=log)
        except FileNotFoundError:
            if not errors:
                discard_folder(folder)
            raise ConfigError("srun is not on PATH, inside an allocation (SLURM_JOB_ID is set)") from None
        watch, stopped = BeatWatch(beats(folder, task)), None
        start_by, started = time.monotonic() + cfg.setup_timeout_s, False
        while proc.poll() is None:
            if on_state is not None:
                on_state([f"srun step {task + 1}/{opts.array} RUNNING"])
            started = started or any(folder.glob(f"task-{task}-rank-*.log"))  # srun opens them as tasks start
            if not started and time.monotonic() > start_by:  # srun waits for resources for ever
                _end(proc)
                said = slurm_message(srun_log.read_text(encoding="utf-8", errors="replace"))
                if not errors:
                    discard_folder(folder)
                raise ConfigError(
                    f"srun could not start the step in {cfg.setup_timeout_s:g} s (--setup-timeout): "
                    f"{said or 'the allocation has no free resources for it'}"
                )
            found = None if stopped or _ending(srun_log) else watch.stale(cfg.timeout_s)
            if found is not None:  # a rank stopped (SIGSTOP): its peers may wait on it for the setup timeout
                rank, seconds, step = found
                stopped = stopped_failure(rank, seconds, folder / f"task-{task}-rank-{rank}.log")
                if not kill_step(step):
                    proc.terminate()  # srun passes it on to the step's tasks
            time.sleep(poll_s)
        if stopped is not None:
            errors.append(stopped)
            continue
        if proc.returncode != 0 and not list(folder.glob(f"task-{task}-rank-*.log")):  # no rank started
            said = slurm_message(srun_log.read_text(encoding="utf-8", errors="replace"))
            if not errors:
                discard_folder(folder)
            raise ConfigError(f"srun refused the step: {said or f'exit status {proc.returncode}'}")
        errors.append((None, None) if proc.returncode == 0 else _step_error(folder, task, proc.returncode))
    return errors


def step_launch(folder: Path, task: int) -> str:
    """The launch key of array task `task`'s step, run from the steps' `folder`."""
    return f"{folder.name}/t{task}"


def _end(proc: subprocess.Popen) -> None:
    """End an srun that has not started its step (it then gives up the request)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class SrunExecutor:
    """Array tasks as srun steps of the current allocation, one after the other."""

    def __init__(self, cfg: RunConfig, opts: SlurmOptions, on_state: Callable | None = None, say=print) -> None:
        self.cfg, self.opts, self.on_state, self.say = cfg, opts, on_state, say

    def launch(self, tasks: list[int], decided: dict[str, dict]) -> list[Outcome]:
        left = tasks_with_work(self.cfg, tasks, self.opts.array, decided)
        if not left:
            self.say("nothing to run: every item's outputs exist (use --overwrite to redo them)")
            return [Outcome(t) for t in tasks]
        self.say(f"executor: srun in allocation {os.environ.get('SLURM_JOB_ID')}")
        folder: list[Path] = []
        failures = run_steps(self.cfg, self.opts, decided, self.on_state, tasks=left, folder=folder)
        return [Outcome(t) for t in tasks if t not in left] + [
            Outcome(t, error, rank, f"step {t}", holder=step_launch(folder[0], t) + "/")
            for t, (error, rank) in zip(left, failures, strict=True)
        ]

    def report(self) -> dict:
        return aggregate(self.cfg.out_dir)


def srun_command(cfg: RunConfig, folder: Path, task: int, call: Path) -> list[str]:
    """The job step of one array task: a task per rank, each on its own GPU when the run
    computes on GPUs; `--kill-on-bad-exit` ends the step when one rank fails (its NCCL peers
    would otherwise wait in their collectives until the watchdog). `--overlap`: the step may
    share the allocation's resources with the step this command runs in (an `srun --pty bash`
    shell holds them all; without it the new step waits for them for ever)."""
    gpus = [f"--gpus-per-node={cfg.gpus_per_node}"] if cfg.device == "cuda" else []
    return [
        "srun",
        f"--nodes={cfg.nodes}",
        f"--ntasks-per-node={cfg.gpus_per_node}",
        *gpus,
        "--overlap",
        "--kill-on-bad-exit=1",
        f"--output={folder}/task-{task}-rank-%t.log",
        sys.executable,
        "-m",
        "slurm.launchers.srun",
        str(call),
    ]


def _ending(srun_log: Path) -> bool:
    """Whether srun reported a task's end: it is ending the step, and a rank it killed after a
    peer failed beats no more without being the cause."""
    try:
        return bool(srun_task_ends(srun_log.read_text(encoding="utf-8", errors="replace")))
    except OSError:
        return False


def allocation_gpus_per_node() -> int | None:
    """GPUs per node of the current allocation (None: none was requested, or Slurm cannot
    say). SLURM_GPUS_ON_NODE (batch script and steps), else the request as salloc passes it on
    (SLURM_GPUS_PER_NODE, e.g. "8" or "h100:8"), else SLURM_JOB_GPUS (the GPU indices of this
    node), else the job's record: `salloc --gres=gpu:8` sets none of these in its shell, and
    only `scontrol show job` says what was allocated (`allocated_gpus_per_node`)."""
    on_node = digits(os.environ.get("SLURM_GPUS_ON_NODE"))
    if on_node is not None:
        return on_node
    per_node = os.environ.get("SLURM_GPUS_PER_NODE")
    if per_node:
        count = digits(per_node.split(",")[0].split(":")[-1].split("(")[0])
        if count is not None:
            return count
    ids = os.environ.get("SLURM_JOB_GPUS")
    if ids:
        return len([i for i in ids.split(",") if i.strip()])
    job = os.environ.get("SLURM_JOB_ID", "")
    if not _JOB_ID.fullmatch(job):
        return None
    try:
        shown = run_slurm(["scontrol", "show", "job", "--oneliner", job])
    except ConfigError:
        return None
    return allocated_gpus_per_node(shown.stdout) if shown.returncode == 0 else None


def allocated_gpus_per_node(record: str) -> int | None:
    """GPUs per node from a `scontrol show job` record: TresPerNode=gres:gpu[:type]:N (or
    gres/gpu), else the job's TRES gres/gpu=N over NumNodes; 0 when it has no GPU."""
    per_node = re.search(r"TresPerNode=\S*?gres[:/]gpu(?::[^:,\s]+)?:(\d+)", record)
    if per_node:
        return int(per_node.group(1))
    total = re.search(r"\bTRES=\S*?gres/gpu=(\d+)", record)
    nodes = re.search(r"\bNumNodes=(\d+)", record)
    if total is None:
        return 0 if re.search(r"\bTRES=", record) else None
    return int(total.group(1)) // max(1, int(nodes.group(1)) if nodes else 1)


_JOB_ID = re.compile(r"[0-9]+")


def _step_error(folder: Path, task: int, returncode: int) -> tuple[str, int | None]:
    """(error, rank) of the rank of this step that failed first (not a peer it took down): one
    that raised (each writes its .error file as it goes), or one that died by a signal without
    a word (kill -9, the OOM killer) if srun reported its end first (task-<task>-srun.log keeps
    srun's messages; later signal deaths are srun ending the step). Among those, the first srun
    reported, then the first written; without one, the first peer's reaction."""
    from slurm.job_errors import srun_task_ends

    found = sorted(folder.glob(f"task-{task}-rank-*.error"), key=lambda p: p.stat().st_mtime)
    errors = [(p.read_text(encoding="utf-8").strip(), int(p.name.split("-rank-")[1].split(".")[0])) for p in found]
    try:
        ends = srun_task_ends((folder / f"task-{task}-srun.log").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        ends = []
    reported = {r: i for i, (ranks, _) in enumerate(ends) for r in ranks}  # a rank's last report wins
    causes = [(reported.get(r, len(ends)), n, r, e) for n, (e, r) in enumerate(errors) if not is_peer_failure(e)]
    if ends and not ends[0][1].startswith("Exited with exit code"):
        wrote = {r for _, r in errors}
        for r in ends[0][0]:
            if r in wrote:
                continue
            log = folder / f"task-{task}-rank-{r}.log"
            line = f"rank {r}: killed by a signal, without an error (srun: task {r}: {ends[0][1]}; log: {log})"
            causes.append((reported[r], len(errors), r, line))
    if causes:
        _, _, rank, error = min(causes)
        return error, rank
    if errors:
        return errors[0]
    return f"srun exited with code {returncode} (logs: {folder}/task-{task}-rank-*.log)", None


def beats(folder: Path, task: int) -> Path:
    """Where the ranks of array task `task`'s step write their heartbeats."""
    return folder / f"task-{task}-beats"


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
    os.environ.setdefault("MASTER_PORT", str(rendezvous_port(seed)))


def main(call: Path) -> None:
    from slurm.launchers.sbatch import SlurmRun

    with open(call, "rb") as f:
        cfg, task, tasks, decided = pickle.load(f)  # written by run_steps for this step
    _step_environment()
    try:
        SlurmRun()(cfg, task, tasks, decided, beats(call.parent, task))
    except BaseException as exc:
        exit_soon()  # SlurmRun armed it already, unless it failed before that
        rank = os.environ.get("SLURM_PROCID", "0")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        (call.parent / f"task-{task}-rank-{rank}.error").write_text(f"rank {rank}: {type(exc).__name__}: {first}\n")
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]))
