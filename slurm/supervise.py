"""The one supervisor of every executor: launch, blame a failure, retry, relaunch.

An executor (local processes, srun steps of an allocation, sbatch jobs) launches array
tasks and says how each ended (`Outcome`). The supervisor owns the loop around it, the same
for all three: after a failed launch it blames the items marked running since the launch
began (the failed rank's replica's share when the rank is known), records the failure,
gives an item up after `cfg.retries` retries, and relaunches the array tasks that still
have work, skipping what is settled. A cancelled job is final; a failure outside any item
(the model does not load) is not retried. The CLI only renders what it reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from runtime.config import RunConfig
from runtime.errors import OutputWriteError
from runtime.outputs import (
    STATE_DIR,
    damaged_sidecars,
    fs_clock,
    item_status,
    record_failure,
    running_items,
    settled_since,
)
from runtime.pull import open_batch
from runtime.resume import plan_resume
from slurm.sharding import share


@dataclass(frozen=True)
class Outcome:
    """How one array task's launch ended."""

    task: int
    error: str | None = None  # None: it succeeded
    rank: int | None = None  # the global rank that failed first, when known
    name: str | None = None  # "job 123", "step 0": what the error is about (none locally)
    cancelled: bool = False
    holder: str | None = None  # under the queue: the launch key its failed workers' leases start with

    @property
    def message(self) -> str:
        return f"{self.name}: {self.error}" if self.name else str(self.error)


class Executor(Protocol):
    def launch(self, tasks: list[int], decided: dict[str, dict]) -> list[Outcome] | None:
        """Run these array tasks; `decided`: records of items settled by earlier launches of
        this command (not run again). None: submitted, not waited for."""


@dataclass
class Supervised:
    """What the supervisor reports: `errors` (one line each) when the run ended in a failure
    that retrying cannot help; `submitted` when jobs were only submitted."""

    errors: list[str] = field(default_factory=list)
    submitted: bool = False
    notes: list[str] = field(default_factory=list)  # workers lost while the others finished the batch


def supervise(cfg: RunConfig, executor: Executor, tasks: int, say: Callable[[str], None]) -> Supervised:
    attempts: dict[str, int] = {}
    given_up: dict[str, dict] = {}
    since = fs_clock(cfg.out_dir)
    if not cfg.overwrite:
        for line in damaged_sidecars(cfg):
            say(line)
    queue = open_batch(cfg) if cfg.queue.shared else None
    todo = list(range(tasks))
    while todo:
        decided = {**settled_since(cfg, since), **given_up}  # from earlier launches of this command
        attempt = fs_clock(cfg.out_dir)
        outcomes = executor.launch(todo, decided)
        if outcomes is None:
            return Supervised(submitted=True)
        failed = [o for o in outcomes if o.error]
        if not failed:
            break
        if any(o.cancelled for o in failed):
            return Supervised([f"{o.name} {'was cancelled' if o.cancelled else 'failed'}: {o.error}" for o in failed])
        # Outputs that cannot be written (a full disk): every attempt would meet the same disk.
        retry = not any(cannot_write(o.error) for o in failed)
        lines, recorded = [], True
        for o in failed:  # each task's own error, on that task's (replica's) items
            if queue is not None:  # the leases its workers held
                said, ok = break_leases(cfg, queue, o, given_up, retry)
            else:
                items = share_of_rank(cfg, o.rank, o.task, tasks)
                said, ok = blame(cfg, o.message, attempts, given_up, attempt, items, retry)
            lines, recorded = lines + said, recorded and ok
        if queue is not None:
            lines += recorded_failures(queue, attempt, retry)  # those its workers recorded themselves
            if not queue.left():  # the workers that were left finished the batch
                return Supervised(notes=[f"{lost(o)}; the other workers finished the batch" for o in failed] + lines)
        if not lines:  # a failure outside any item: retrying cannot help
            return Supervised([o.message if o.name is None else f"{o.name} failed: {o.error}" for o in failed])
        if not (retry and recorded):
            return Supervised(lines)
        for line in lines:
            say(line)
        settled = {**settled_since(cfg, since), **given_up}
        todo = [
            t
            for t in range(tasks)
            if any(i.id not in settled and item_status(cfg, i) != "done" for i in share(cfg, t, tasks))
        ]
    return Supervised()


def lost(o: Outcome) -> str:
    return f"{o.name or 'a worker'} was lost ({o.error})" if o.name else f"a worker was lost ({o.error})"


def break_leases(cfg: RunConfig, queue, o: Outcome, given_up: dict, retry: bool) -> tuple[list[str], bool]:
    """After a launch's workers failed (their processes are gone): record the attempts their
    leases held failed, with their error, so that the items go on at once (no wait for the
    leases to run out); given up after `cfg.retries` retries (at once without `retry`). A line
    per item, and whether each failure could be recorded (see `blame`)."""
    lines, recorded = [], True
    holder = o.holder or ""
    for lease in queue.leases_of(lambda data: holder and str(data.get("launch", "")).startswith(holder)):
        item = next(i for i in cfg.items if i.id == lease.item)
        try:
            done, final = queue.fail(lease, o.message, not retry, "launcher")
            if not done:  # another worker took it over first
                continue
            n = queue.state(item.id).leases
            record = record_failure(cfg, item, o.message, n, final=final)
        except OutputWriteError as exc:
            lines.append(f"{item.id} failed ({o.message}); the failure could not be recorded ({exc}); {STOPPED}")
            recorded = False
            continue
        if final:
            given_up[item.id] = record
        lines.append(attempt_line(item.id, o.message, n, final, cfg.retries, retry))
    return lines, recorded


def attempt_line(item_id: str, error: str, n: int, final: bool, retries: int, retry: bool = True) -> str:
    if not retry:
        return f"{item_id} failed ({error}); not retried: {STOPPED}"
    if final:
        return f"{item_id} failed ({error}); giving it up after {n} attempt(s)"
    return f"{item_id} failed ({error}); retry {n} of {retries}"


def recorded_failures(queue, since: float, retry: bool = True) -> list[str]:
    """A line per failure the workers recorded in the queue since `since` (fs_clock)."""
    return [
        attempt_line(item, data.get("error") or "failed", attempts, bool(data.get("final")), queue.retries, retry)
        for item, data, attempts in queue.failures_since(since)
        if data.get("recorded_by") != "launcher"
    ]


def tasks_with_work(cfg: RunConfig, tasks: list[int], total: int, decided: dict[str, dict]) -> list[int]:
    """Of `tasks` (of `total` array tasks), those with an item neither complete on disk (see
    `plan_resume`) nor settled by an earlier launch: decided before anything is launched, so
    a task with nothing left starts no rank and submits no job."""
    done = {**plan_resume(cfg), **decided}
    return [t for t in tasks if any(i.id not in done for i in share(cfg, t, total))]


def blame(
    cfg: RunConfig,
    error: str,
    attempts: dict[str, int],
    given_up: dict[str, dict],
    since: float,
    items=None,
    retry: bool = True,
) -> tuple[list[str], bool]:
    """After a launch that started at `since` (fs_clock) failed: record each of `items`
    (default all) marked running since then as failed, count the attempt and give the item up
    after `cfg.retries` retries (at once without `retry`). A line per item (none: nothing to
    blame), and whether every failure could be recorded: a sidecar that cannot be written (a
    full disk) stays "running", so a later run makes that item again, but this one must stop."""
    lines, recorded = [], True
    for item in running_items(cfg, since, items):
        n = attempts[item.id] = attempts.get(item.id, 0) + 1
        try:
            record = record_failure(cfg, item, error, n)
        except OutputWriteError as exc:
            lines.append(f"{item.id} failed ({error}); the failure could not be recorded ({exc}); {STOPPED}")
            recorded = False
            continue
        if not retry:
            given_up[item.id] = record
            lines.append(f"{item.id} failed ({error}); not retried: {STOPPED}")
        elif n > cfg.retries:
            given_up[item.id] = record
            lines.append(f"{item.id} failed ({error}); giving it up after {n} attempt(s)")
        else:
            lines.append(f"{item.id} failed ({error}); retry {n} of {cfg.retries}")
    return lines, recorded


STOPPED = "the run stops, keeping what it finished; the same command resumes once the output folder takes writes"


def cannot_write(error: str | None) -> bool:
    """Whether a launch failed on an output it could not write, as any executor reports it
    (the exception's name and message: from this process, a rank, or a job's log)."""
    return error is not None and f"{OutputWriteError.__name__}: " in error


def replica_share(cfg: RunConfig, replica: int, report_name: str) -> tuple[RunConfig | None, str]:
    """The items (round-robin with --queue static, else every one) and report file of one
    replica; (None, name) when it gets no item."""
    if cfg.replicas == 1:
        return cfg, report_name
    items = tuple(share(cfg, replica, cfg.replicas))
    task = "" if report_name == "report.json" else Path(report_name).stem + "."
    return (replace(cfg, items=items) if items else None), f"{REPORTS}/{task}replica-{replica}.json"


def share_of_rank(cfg: RunConfig, rank: int | None, task: int = 0, tasks: int = 1):
    """The items a global rank of array task `task` works on (all of the task's when unknown)."""
    items = tuple(share(cfg, task, tasks))
    if rank is None or cfg.replicas == 1 or not items:
        return items
    mine, _ = replica_share(replace(cfg, items=items), rank // cfg.layout.world_size, "")
    return mine.items if mine is not None else ()


def task_report(task: int, tasks: int | None = None, prefix: str = "") -> str:
    """The report file (relative to the output folder) array task `task` of `tasks` writes:
    report.json itself for a single local task, else one in the bookkeeping folder, which
    `ditango report` (slurm/aggregate.py) merges into report.json. `prefix`: a --join's (its
    reports never overwrite the batch owner's)."""
    return "report.json" if tasks == 1 and not prefix else f"{REPORTS}/{prefix}task-{task}.json"


REPORTS = f"{STATE_DIR}/reports"  # task and replica reports
