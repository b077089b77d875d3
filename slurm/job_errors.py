"""What a finished Slurm job says went wrong: the rank that failed first and its error, read
from submitit's logs and srun's reports of the tasks' ends; and the state of every job a
folder submitted (`ditango status`)."""

from __future__ import annotations

import re
from pathlib import Path

import submitit

from basics.errors import ConfigError
from basics.user_files import digits, require_regular_file
from runtime.errors import is_peer_failure
from slurm.jobs import cancelled_jobs, failed_state, job_ids, read_jobs, slurm_states

# The line the job prints when an attempt starts: the logs after it are that attempt's.
ATTEMPT_MARK = "ditango: job attempt starts"


def job_error(job: submitit.Job, read_results: bool = True) -> str | None:
    """The most telling error of a finished job (see `job_failure`)."""
    return job_failure(job, read_results)[0]


# How much of a task's log is read for its exception: its end, where the traceback is.
LOG_TAIL = 2**20


def logged_exception(task) -> str | None:
    """The exception a task's stderr log shows (its last attempt's traceback, read as text, the
    end of the log only), None when it shows none: what `task.exception()` says, without
    unpickling the task's result file. A file that is no regular file is not read."""
    path = task.paths.stderr
    try:
        require_regular_file(path, "log")
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - LOG_TAIL))
            text = f.read().decode("utf-8", errors="replace")
    except (OSError, ConfigError):
        return None
    text = _RANK_PREFIX.sub("", text.rpartition(ATTEMPT_MARK)[2])
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return text if any(ln.split(":")[0].endswith(EXCEPTION_ENDS) for ln in lines) else None


EXCEPTION_ENDS = ("Error", "Exception", "Interrupt")  # how the class of a raised exception line ends
# torch.distributed's prefix on each line a rank's uncaught exception prints ("[rank1]: ...")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.MULTILINE)


def job_failure(job: submitit.Job, read_results: bool = True) -> tuple[str | None, int | None]:
    """(error, rank) of a finished job: the rank that failed first, where that can be told.

    A cause is a task's own exception line (the rank that raised), or a task that died by a
    signal without one ("task 2: Killed": kill -9, the OOM killer) if srun reported its end
    first. srun's messages (in task 0's stderr) list the tasks' ends in the order they came;
    signal deaths after the first are srun ending the step (--kill-on-bad-exit), not causes.
    Among causes, the one srun reported first, else the lowest task. Without a cause: a peer's
    reaction ('timed out', 'connection closed'), then the last line of a task that left no
    exception, with the rank unknown (None). `read_results` False: each task's exception is
    read from its log (`logged_exception`), never from its result file, which submitit would
    unpickle: `ditango status` reads a folder others may write to."""
    ends = attempt_task_ends(job)
    reported = {t: i for i, (tasks, _) in enumerate(ends) for t in tasks}  # a task's last report wins
    how_ended = {t: how for tasks, how in ends for t in tasks}
    first_tasks, first_how = ends[0] if ends else ((), "")
    killed_first = first_tasks if first_how and not first_how.startswith("Exited with exit code") else ()
    causes, secondary, other = [], [], []
    for t in range(max(1, job.num_tasks)):
        task = job.task(t) if job.num_tasks > 1 else job
        how = how_ended.get(t, "")
        if how and not how.startswith("Exited with exit code") and not task.paths.result_pickle.exists():
            # Died by a signal, so it left no result: asking submitit for one would wait 15 s
            # for a file that never appears. The first reported death is a cause; a later one
            # is srun ending the step after another task failed.
            if t in killed_first:
                log = task.paths.stderr
                line = f"rank {t} was killed by a signal, without an exception (srun: task {t}: {how}; log: {log})"
                causes.append((reported[t], t, line))
            else:
                other.append(f"rank {t}: {how} (srun ended it after another task failed)")
            continue
        exc = task.exception() if read_results else logged_exception(task)
        if exc is None:
            continue
        text = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raised = [ln for ln in text if ln.split(":")[0].endswith(EXCEPTION_ENDS)]
        if raised:
            line = _DOTTED.sub(r"\1", raised[-1])
            if is_peer_failure(line):
                secondary.append(line)
            else:
                causes.append((reported.get(t, len(ends)), t, line))
        else:
            other.append(text[-1] if text else type(exc).__name__)
    if causes:
        _, rank, line = min(causes)
        return line, rank
    return ((secondary or other)[0], None) if secondary or other else (None, None)


def attempt_task_ends(job: submitit.Job) -> list[tuple[tuple[int, ...], str]]:
    """srun's reports of the tasks that ended in the job's current attempt (in task 0's stderr,
    after the last ATTEMPT_MARK: not a requeued attempt's), in the order they came."""
    try:
        log = job.paths.stderr.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return srun_task_ends(log.rpartition(ATTEMPT_MARK)[2])


# "runtime.errors.ConfigError: ..." -> "ConfigError: ...": the class says enough.
_DOTTED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(\w+(?:Error|Exception|Interrupt):)")


# srun's report of tasks that ended badly: "srun: error: node2: task 2: Killed",
# "srun: error: node1: tasks 0-1,3: Exited with exit code 1".
_SRUN_END = re.compile(r"^srun: error: \S+: tasks? ([0-9][0-9,\-]*): (.+)$", re.MULTILINE)


def srun_task_ends(text: str) -> list[tuple[tuple[int, ...], str]]:
    """The task ends srun reported in `text` (its stderr), in order: (tasks, how), how being
    "Killed", "Terminated", "Exited with exit code 1", ... ("tasks 0-1,3" -> (0, 1, 3))."""
    ends = []
    for match in _SRUN_END.finditer(text):
        tasks: list[int] = []
        for part in match.group(1).split(","):
            first, dash, last = part.partition("-")
            low, high = digits(first), digits(last if dash else first)
            if low is not None and high is not None:
                tasks += range(low, high + 1)
        ends.append((tuple(tasks), match.group(2).strip()))
    return ends


def job_states(out_dir: Path) -> list[dict]:
    """Current state of every job submitted from `out_dir` (`slurm_states`; "UNKNOWN" for a
    job Slurm has no record of), with the error of each failed one."""
    record = read_jobs(out_dir)
    states = slurm_states(job_ids(record))
    cancelled = cancelled_jobs(out_dir)
    rows = []
    for submission in record:
        for job_id in submission["job_ids"]:
            state = states.get(job_id, "UNKNOWN")
            error = None
            if job_id in cancelled and (failed_state(state) or state == "UNKNOWN"):
                state, error = "CANCELLED", f"cancelled with `ditango cancel` at {cancelled[job_id]}"
            elif failed_state(state):
                error = _logged_error(out_dir, submission, job_id)
            rows.append(
                {
                    "job_id": job_id,
                    "state": state,
                    "error": error,
                    "submitted_at": submission["submitted_at"],
                    "cancelled": job_id in cancelled,
                }
            )
    return rows


def _logged_error(out_dir: Path, submission: dict, job_id: str) -> str | None:
    """The error a failed job left in its submission folder, OUT/slurm/<name> (read there
    whatever path jobs.json gives), from its logs as text: nothing in the folder is unpickled."""
    name = Path(submission["folder"]).name
    folder = out_dir / "slurm" / name
    if name in ("", ".", "..") or not folder.is_dir():
        return f"(its logs are gone: no {submission['folder']})"
    job = submitit.SlurmJob(folder=folder / "%j", job_id=job_id, tasks=tuple(range(submission["tasks"])))
    try:
        return job_error(job, read_results=False)
    except OSError as exc:
        return f"(its logs in {folder} cannot be read: {exc.strerror or exc})"
