"""Slurm jobs through submitit: one multi-node job (or an array of them) per batch.

Each Slurm task is one rank. The job runs a pickled callable (`SlurmRun`), never a
shell line built from user input, on a snapshot of the code as submitted. `SlurmRun` is
checkpointable: on preemption or at the time limit submitit calls `checkpoint()` (one
rank, in a signal handler: no collectives) and requeues the same call, which resumes the
batch because finished items are skipped.

Bookkeeping lives in the output folder: `slurm/` (submitit logs and pickles, one folder
per submission), `.ditango/jobs.json` (the job record, slurm/jobs.py: what `ditango status`
and `ditango cancel` read), one `.ditango/reports/task-<i>.json` per array task, and
`report.json` aggregated by `ditango report`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import submitit
import torch.distributed as dist
from submitit.core.utils import FailedJobError, FailedSubmissionError

from basics.errors import ConfigError
from runtime.batch_queue import slurm_job
from runtime.config import RunConfig
from runtime.context import SilentObserver
from runtime.progress import LogObserver
from slurm.aggregate import aggregate
from slurm.entry import run_rank
from slurm.heartbeat import BeatWatch, Heartbeat, kill_step, stopped_failure
from slurm.job_errors import ATTEMPT_MARK, attempt_task_ends, job_failure
from slurm.jobs import (
    check_job_id,
    discard_folder,
    jobs_file,
    partition_nodes,
    recorded_jobs,
    run_slurm,
    slurm_message,
    write_jobs,
)
from slurm.options import NodeSize, SlurmOptions, submitit_parameters
from slurm.rank import (
    apply_environment,
    choose_gloo_interface,
    exit_soon,
    join,
    rendezvous_port,
    select_device,
)
from slurm.sharding import share
from slurm.supervise import Outcome, task_report, tasks_with_work

CODE_PACKAGES = ("ditango_cli", "runtime", "planner", "slurm", "basics")


def snapshot_code(dest: Path) -> Path:
    """Copy the project's packages as they are now, so a queued job does not run whatever
    is checked out when it starts."""
    root = Path(__file__).resolve().parents[2]  # slurm/launchers/sbatch.py: the checkout
    for name in CODE_PACKAGES:
        shutil.copytree(root / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return dest


class SlurmRun(submitit.helpers.Checkpointable):
    """One array task of a batch, on every rank of its job (or srun step)."""

    def __call__(
        self, cfg: RunConfig, task: int, tasks: int, decided: dict | None = None, beats: Path | None = None
    ) -> dict | None:
        """`beats`: the folder of the ranks' heartbeats (default: the job's own folder's)."""
        os.environ.setdefault("MASTER_PORT", str(rendezvous_port(os.environ.get("SLURM_JOB_ID", ""))))
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        heartbeat = Heartbeat(beats or beat_folder(submitit.JobEnvironment().paths.folder), env.rank)
        try:
            return self._rank(cfg, task, tasks, decided, env)
        finally:
            heartbeat.stop()

    def _rank(self, cfg, task, tasks, decided, env) -> dict | None:
        apply_environment(cfg.out_dir)
        # The GPU of this task on its node (SLURM_LOCALID), whatever its rank inside a replica.
        device = select_device(cfg.device, env.local_rank)
        # With --replicas, each replica is its own process group, meeting at its first rank's node.
        size = cfg.layout.world_size
        replica, rank = divmod(env.rank, size)
        init = {"rank": env.rank, "world_size": env.world_size}
        job = submitit.JobEnvironment()
        if job.num_nodes > 1:  # gloo on the interface the nodes reach each other through
            choose_gloo_interface([h for h in job.hostnames if h != job.hostname])
        if cfg.replicas > 1:
            leader = job.hostnames[(replica * size) // (env.world_size // job.num_nodes)]
            init = {"rank": rank, "world_size": size, "init_method": f"tcp://{leader}:{env.master_port + 1 + replica}"}
        join(device, timeout_s=cfg.setup_timeout_s, **init)
        try:
            result = self._run(cfg, task, tasks, decided, env.rank, rank, size, replica, device)
        except BaseException:
            # Out without destroy_process_group (it can block on a dead peer) and within a
            # deadline: srun's --kill-on-bad-exit then ends the peers, which under NCCL would
            # otherwise spin in their collective until the watchdog fires.
            exit_soon()
            raise
        dist.destroy_process_group()
        return result

    @staticmethod
    def _run(cfg, task, tasks, decided, global_rank, rank, size, replica, device) -> dict | None:
        # The real topology: which node each rank is on (byte counters, DiTango groups).
        node_of = [None] * size
        dist.all_gather_object(node_of, submitit.JobEnvironment().node)
        items = tuple(share(cfg, task, tasks))
        if not items:
            return None
        if not cfg.queue.launch:  # a job's (an srun step's is set by its launcher): its workers' leases carry it
            cfg = replace(cfg, queue=replace(cfg.queue, launch=job_launch(slurm_job(), task)))
        # The writer (of each replica) logs its progress as plain lines into its stderr, the job's log.
        observer = LogObserver(sys.stderr) if rank == 0 else SilentObserver()
        return run_rank(
            replace(cfg, items=items),
            rank,
            tuple(node_of),
            replica,
            task_report(task, None, cfg.queue.report),
            observer,
            global_rank,
            device,
            decided=decided,
        )


def job_launch(job_id: str, task: int) -> str:
    """The launch key of array task `task` run as Slurm job `job_id` (as submitit names it)."""
    return f"slurm-{job_id}/t{task}"


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """Jobs and srun steps start in the code snapshot: every path they get must be absolute."""
    return replace(
        cfg, out_dir=cfg.out_dir.resolve(), model_path=None if cfg.model_path is None else cfg.model_path.resolve()
    )


def submission_config(cfg: RunConfig) -> RunConfig:
    """The config a job runs: absolute paths, and the device intent made explicit: a
    submission computes on GPUs unless told `--device cpu`, and a compute node without one
    is then an error, not a silent CPU run."""
    return replace(absolute_paths(cfg), device="cpu" if cfg.device == "cpu" else "cuda")


def job_parameters(cfg: RunConfig, opts: SlurmOptions, code: Path) -> dict:
    """`SlurmExecutor.update_parameters(**this)` for a submission of `submission_config(cfg)`
    running the snapshot at `code`."""
    params = submitit_parameters(cfg, opts, use_gpus=cfg.device == "cuda", node=partition_node(opts))
    # Run from the snapshot: the job's working directory is the first entry of its sys.path
    # (python -m), ahead of PYTHONPATH and of an editable install of the checkout.
    # Each start of the job (a requeue appends to the same log) leaves a marker in task 0's
    # stderr, where srun reports its tasks' ends: only the last attempt's reports are read.
    # Every value in the script's body is shell-quoted: the output folder is the user's text.
    params["setup"] = [
        f'export PYTHONPATH={shlex.quote(str(code))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        f"echo {shlex.quote(ATTEMPT_MARK)} >&2",
    ]
    params.setdefault("additional_parameters", {})["chdir"] = str(code)
    return params


def partition_node(opts: SlurmOptions) -> NodeSize | None:
    """The smallest node of the partition the job goes to (sinfo), when Slurm says."""
    found = partition_nodes(opts.partition)
    return None if found is None else NodeSize(*found)


def submission_folder(cfg: RunConfig) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return cfg.out_dir / "slurm" / stamp


def sbatch_script(cfg: RunConfig, opts: SlurmOptions, folder: Path, jobs: int) -> str:
    """The sbatch script `submit` would hand to Slurm for `jobs` array tasks, rendered by
    submitit's own template (the function its SlurmExecutor calls), without submitting."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder / "%j"))])
    params = job_parameters(cfg, opts, folder / "code")
    return _make_sbatch_string(command=command, folder=folder / "%j", map_count=jobs if jobs > 1 else None, **params)


def submit(
    cfg: RunConfig, opts: SlurmOptions, decided: dict | None = None, tasks: list[int] | None = None
) -> list[submitit.Job]:
    """Submit the batch as `opts.array` tasks (one multi-node job each); record the job ids.

    `decided`: records of items settled by earlier submissions of this command (not run again);
    `tasks`: the array tasks to submit (default all), e.g. only those with work left. A job
    Slurm refuses (bad partition, say) is a ConfigError with sbatch's own message, and the
    submission folder goes; so does a damaged jobs.json, before anything is submitted."""
    if opts.array > len(cfg.items):
        raise ConfigError(f"--array {opts.array} is more than the {len(cfg.items)} items")
    cfg = submission_config(cfg)
    record = recorded_jobs(cfg.out_dir) or []  # appended to, so refuse a damaged one now, not overwrite it
    jobs_file(cfg.out_dir).parent.mkdir(parents=True, exist_ok=True)
    folder = submission_folder(cfg)
    try:
        code = snapshot_code(folder / "code")
        executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=20)
        executor.update_parameters(**job_parameters(cfg, opts, code))
        tasks = list(range(opts.array)) if tasks is None else tasks
        n, total = len(tasks), opts.array
        jobs = _sbatch(lambda: executor.map_array(SlurmRun(), [cfg] * n, tasks, [total] * n, [decided or {}] * n))
    except BaseException as exc:
        discard_folder(folder)
        if isinstance(exc, OSError):
            raise ConfigError(f"cannot prepare the submission in {folder}: {exc.strerror or exc}") from None
        raise
    ids = [check_job_id(j.job_id) for j in jobs]
    record.append({"submitted_at": folder.name, "folder": str(folder), "job_ids": ids, "tasks": cfg.world_size})
    try:
        write_jobs(jobs_file(cfg.out_dir), record)
    except OSError as exc:  # unrecorded jobs could be neither followed nor cancelled: end them
        with contextlib.suppress(ConfigError):
            run_slurm(["scancel", *ids])
        raise ConfigError(
            f"cannot write {jobs_file(cfg.out_dir)} ({exc.strerror or exc}); cancelled job(s) {', '.join(ids)}"
        ) from None
    return jobs


def _sbatch(submission):
    """`submission()` (submitit's sbatch call), its failure as one line with sbatch's message.
    submitit prints sbatch's stderr when sbatch fails: held back, and shown unless it is that."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            return submission()
    except FailedJobError as exc:
        held = io.StringIO()  # sbatch's message: said once, in the error
        raise ConfigError(f"sbatch refused the job: {slurm_message(str(exc)) or 'no message'}") from None
    except FailedSubmissionError:
        raise ConfigError("sbatch gave no job id in its answer: was the job submitted?") from None
    except FileNotFoundError as exc:
        if exc.filename != "sbatch":
            raise
        raise ConfigError("sbatch is not on PATH (is this a Slurm login node?)") from None
    finally:
        sys.stderr.write(held.getvalue())


def beat_folder(job_folder: Path) -> Path:
    """Where the ranks of the job whose submitit folder is `job_folder` write their heartbeats."""
    return job_folder / "beats"


def wait(
    jobs: list[submitit.Job], on_state=None, poll_s: float = 2.0, force_s: float = 10.0, stale_s: float | None = None
) -> tuple[list[tuple[str | None, int | None]], set[str]]:
    """Block until every job is done; returns each job's (error, failing rank), error None when
    it succeeded, and the ids of the jobs ended here because a rank stopped: with `stale_s`, a
    running job whose rank's heartbeat stood still longer than that is cancelled, that rank
    blamed. submitit asks sacct at 2, 4, 8, ... 64 s, then every minute, unless every task left
    a result; a job killed by srun leaves none, so ask sacct every `force_s` seconds too."""
    last_forced = time.monotonic()
    watches = {j.job_id: BeatWatch(beat_folder(j.paths.folder)) for j in jobs}
    stopped: dict[str, tuple[str, int]] = {}
    while True:
        force = time.monotonic() - last_forced >= force_s
        if force:
            last_forced = time.monotonic()
        done = [j.done(force_check=force) for j in jobs]
        if all(done):
            break
        for job, finished in zip(jobs, done, strict=True):
            if finished or stale_s is None or job.job_id in stopped:
                continue
            watch = watches[job.job_id]
            if job.state != "RUNNING":  # pending, or requeued: its ranks' files are an earlier attempt's
                watch.reset()
                continue
            found = watch.stale(stale_s)
            # Not stale news: the job still runs, and srun has not begun to end its step (a rank
            # killed by srun after a peer failed beats no more; the peer's error is the cause).
            if (
                found is not None
                and not attempt_task_ends(job)
                and not job.done(force_check=True)
                and job.state == "RUNNING"
            ):
                rank, seconds, step = found
                log = (job.task(rank) if job.num_tasks > 1 else job).paths.stderr
                stopped[job.job_id] = stopped_failure(rank, seconds, log)
                if not kill_step(step):
                    with contextlib.suppress(ConfigError):
                        run_slurm(["scancel", "--signal=KILL", job.job_id])
        if on_state is not None:
            on_state([j.state for j in jobs])
        time.sleep(poll_s)
    return [stopped.get(j.job_id) or job_failure(j) for j in jobs], set(stopped)


class SbatchExecutor:
    """Array tasks as one job array of multi-node jobs; with `wait`, followed to their end."""

    def __init__(self, cfg: RunConfig, opts: SlurmOptions, wait: bool, on_state=None, say=print) -> None:
        self.cfg, self.opts, self.wait, self.on_state, self.say = cfg, opts, wait, on_state, say
        self.job_ids: list[str] = []

    def launch(self, tasks: list[int], decided: dict[str, dict]) -> list[Outcome] | None:
        left = tasks_with_work(self.cfg, tasks, self.opts.array, decided)
        if not left:
            self.say("nothing to submit: every item's outputs exist (use --overwrite to redo them)")
            return [Outcome(t) for t in tasks]
        settled = [Outcome(t) for t in tasks if t not in left]
        tasks = left
        jobs = submit(self.cfg, self.opts, decided, tasks)
        self.job_ids = [j.job_id for j in jobs]
        if not self.wait:
            return None
        self.say(f"submitted job(s) {', '.join(self.job_ids)}; waiting (Ctrl-C stops waiting, not the job)")
        failures, stopped = wait(jobs, self.on_state, stale_s=self.cfg.timeout_s)
        return settled + [
            Outcome(
                t,
                error,
                rank,
                f"job {j.job_id}",
                j.state.startswith("CANCELLED") and j.job_id not in stopped,
                holder=job_launch(j.job_id, t) + "/",
            )
            for t, j, (error, rank) in zip(tasks, jobs, failures, strict=True)
        ]

    def report(self) -> dict:
        return aggregate(self.cfg.out_dir)
