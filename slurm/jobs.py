"""A batch's Slurm jobs: the record of what was submitted from an output folder
(`OUT/.ditango/jobs.json`), and Slurm's word on them (squeue, sacct, scancel).

Every job id is checked before it reaches a Slurm command (`check_job_id`: "--version"
would be an option), and passed as `--jobs=<ids>`. A Slurm command that fails, or cannot be
run, is a ConfigError with its own message (`slurm_message`): one line, exit 2. The record
is read through `runtime.outputs.read_json` and its shape checked: a damaged one is refused,
never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import digits
from runtime.outputs import Damaged, read_json, state_dir
from runtime.video import write_json


def jobs_file(out_dir: Path) -> Path:
    """`OUT/.ditango/jobs.json`: one entry per submission from OUT, in order (see `read_jobs`)."""
    return state_dir(out_dir) / "jobs.json"


def read_jobs(out_dir: Path) -> list[dict]:
    """The submissions recorded for `out_dir`, each {"submitted_at": str, "folder": str,
    "job_ids": [str], "tasks": int >= 1}, job ids checked (`check_job_id`). ConfigError when
    nothing was submitted from it; `Damaged` when the file is not such a list."""
    record = recorded_jobs(out_dir)
    if record is None:
        where = jobs_file(out_dir).relative_to(out_dir)
        raise ConfigError(f"{out_dir}: no Slurm job was submitted from this folder (no {where})")
    return record


def check_job_id(job_id: str) -> str:
    """`job_id` if it is a Slurm job id, else a ConfigError: ids reach scancel, squeue and sacct
    as arguments, where "--version" would be an option."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ConfigError(f"{_brief(job_id)} is not a Slurm job id (digits, or digits_digits for an array task)")
    return job_id


_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")  # "123", or "123_4" for task 4 of array job 123


def recorded_jobs(out_dir: Path) -> list[dict] | None:
    """What `read_jobs` returns, None when there is no jobs.json."""
    path = jobs_file(out_dir)
    data = read_json(path, "job record")
    if data is None:
        return None
    problem = _shape_problem(data)
    if problem is not None:
        raise Damaged(f"{path}: damaged job record ({problem})")
    return data


def recorded_job_ids(out_dir: Path) -> set[str]:
    """Every job id submitted from `out_dir` (none without a jobs.json)."""
    return {job for entry in recorded_jobs(out_dir) or () for job in entry["job_ids"]}


MAX_TASKS = 2**16  # ranks of one job: more than any cluster runs as one job


def _shape_problem(data) -> str | None:
    if not isinstance(data, list):
        return f"expected a list of submissions, got {type(data).__name__}"
    for n, entry in enumerate(data, 1):
        if not isinstance(entry, dict):
            return f"submission {n} is {_brief(entry)}, not an object"
        for key in ("submitted_at", "folder"):
            if not isinstance(entry.get(key), str):
                return f"submission {n}: {key} is {_brief(entry.get(key))}, not a string"
        ids, tasks = entry.get("job_ids"), entry.get("tasks")
        if not isinstance(ids, list):
            return f"submission {n}: job_ids is {_brief(ids)}, not a list"
        for job_id in ids:
            try:
                check_job_id(job_id)
            except ConfigError as exc:
                return f"submission {n}: {exc}"
        if not isinstance(tasks, int) or isinstance(tasks, bool) or not 1 <= tasks <= MAX_TASKS:
            return f"submission {n}: tasks is {_brief(tasks)}, not an integer from 1 to {MAX_TASKS}"
    return None


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def write_jobs(path: Path, record: list[dict]) -> None:
    """Atomically, like runtime/video.py: a partial file under a dotted name, renamed into place
    (a killed writer's partial file is removed by the next run that owns the folder)."""
    tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def discard_folder(folder: Path) -> None:
    """Remove a submission (or srun steps) folder nothing ran from, and `slurm/` if it is then
    empty."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # other submissions' folders are in it
        folder.parent.rmdir()


def failed_state(state: str) -> bool:
    """Slurm states that end a job without its work done (e.g. "CANCELLED by 0")."""
    return _base(state) in ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")


def ended_state(state: str) -> bool:
    """Whether a job in this state has ended for good: Slurm's final states (squeue(1), JOB STATE
    CODES). Any other (PENDING, RUNNING, REQUEUED, CONFIGURING, COMPLETING, SUSPENDED,
    RESIZING, ...) is live; so is PREEMPTED, after which Slurm requeues submitit's jobs."""
    return failed_state(state) or _base(state) in ("COMPLETED", "REVOKED")


def _base(state: str) -> str:
    return (state.split() or ["UNKNOWN"])[0]


def live_jobs(out_dir: Path) -> list[tuple[str, str]]:
    """(job id, state) of the jobs submitted from `out_dir` that have not ended (`ended_state`),
    from one squeue call: the controller knows every live job, while accounting (sacct) can lag
    it by seconds. [] when nothing was submitted from `out_dir`, and when squeue is not on PATH
    (a machine outside the cluster, where the folder may have been copied: nothing there can be
    asked, and local runs must not be blocked). A damaged jobs.json or a failing squeue is a
    ConfigError."""
    record = recorded_jobs(out_dir)
    ids = job_ids(record or [])
    if not ids or shutil.which("squeue") is None:
        return []
    states = _squeue(ids)
    return [(i, states[i]) for i in ids if i in states and not ended_state(states[i])]


CANCEL_WAIT_S = 60.0


def cancel(out_dir: Path, wait_s: float = CANCEL_WAIT_S, poll_s: float = 0.5) -> list[tuple[str, str, str | None]]:
    """Cancel the live jobs submitted from `out_dir` and wait (up to `wait_s`) until they have
    ended, so that a rerun can own the folder at once (a job stays live while it completes).
    Per job (id, outcome, state): "cancelled" (the state it was in), "ending" (cancelled, still
    in this state after `wait_s`), "ended" (its final state: it had ended before) or "unknown"
    (None: Slurm has no record of it, e.g. purged from accounting). States are asked first, so
    a failing squeue or sacct cancels nothing; a failing scancel is a ConfigError."""
    ids = job_ids(read_jobs(out_dir))
    states = slurm_states(ids)
    live = [i for i in ids if i in states and not ended_state(states[i])]
    ending: dict[str, str] = {}
    if live:
        run = run_slurm(["scancel", *map(check_job_id, live)])
        if run.returncode != 0:
            raise slurm_failure(run)
        record_cancelled(out_dir, live)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                now = _squeue(live)
            except ConfigError:  # cancelled all the same; only the wait is cut short
                break
            ending = {i: now[i] for i in live if i in now and not ended_state(now[i])}
            if not ending or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)

    def outcome(i: str) -> tuple[str, str, str | None]:
        if i in ending:
            return i, "ending", ending[i]
        return i, "cancelled" if i in live else "ended" if i in states else "unknown", states.get(i)

    return [outcome(i) for i in ids]


def cancelled_file(out_dir: Path) -> Path:
    """`OUT/.ditango/cancelled.json`: {job id: when `ditango cancel` cancelled it (UTC)}."""
    return state_dir(out_dir) / "cancelled.json"


def record_cancelled(out_dir: Path, ids: list[str]) -> None:
    """Remember that the user cancelled these jobs: `status` says so instead of blaming a rank."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(cancelled_file(out_dir), {**cancelled_jobs(out_dir), **dict.fromkeys(ids, stamp)})


def cancelled_jobs(out_dir: Path) -> dict[str, str]:
    """{job id: when} of the jobs `ditango cancel` cancelled ({} for a damaged file: only a label)."""
    try:
        data = read_json(cancelled_file(out_dir), "cancel record")
    except Damaged:
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def slurm_states(ids: list[str]) -> dict[str, str]:
    """{job id: state} of those of `ids` that Slurm knows: from the controller (squeue), which
    is exact for live jobs and for a few minutes after their end (MinJobAge), else from
    accounting (sacct). An id missing from the answer is unknown to Slurm."""
    states = _squeue(ids) if ids else {}
    rest = [i for i in ids if i not in states]
    if rest:
        states.update(_sacct(rest))
    return states


def job_ids(record: list[dict]) -> list[str]:
    return list(dict.fromkeys(j for s in record for j in s["job_ids"]))  # in order, once each


def _squeue(ids: list[str]) -> dict[str, str]:
    run = run_slurm(["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T", _jobs_option(ids)])
    if run.returncode != 0:
        if "Invalid job id specified" in run.stderr:  # what squeue says when it knows none of them
            return {}
        raise slurm_failure(run)
    return _parse_states(run.stdout)


def _sacct(ids: list[str]) -> dict[str, str]:
    run = run_slurm(["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State", _jobs_option(ids)])
    if run.returncode != 0:
        raise slurm_failure(run)
    return _parse_states(run.stdout)


def _jobs_option(ids: list[str]) -> str:
    return "--jobs=" + ",".join(map(check_job_id, ids))


def _parse_states(text: str) -> dict[str, str]:
    """{job id: state} from "JOBID|STATE" lines; sacct writes a pending array as "123_[0-3]"."""
    from submitit.slurm.slurm import read_job_id

    states = {}
    for line in text.splitlines():
        job, _, state = (part.strip() for part in line.partition("|"))
        if not job or "." in job or not state:  # "123.batch": a step, not the job
            continue
        try:
            parts = read_job_id(job)
        except ValueError:
            continue
        for main, *tasks in parts:
            first, last = (int(tasks[0]), int(tasks[-1])) if tasks else (None, None)
            ids = [main] if first is None else [f"{main}_{t}" for t in range(first, last + 1)]
            states.update(dict.fromkeys(ids, state))
    return states


SLURM_TIMEOUT_S = 60


def run_slurm(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a Slurm client command, its arguments already checked; one that cannot run is a
    ConfigError."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=SLURM_TIMEOUT_S
        )
    except FileNotFoundError:
        raise ConfigError(f"{cmd[0]} is not on PATH (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{cmd[0]} gave no answer in {SLURM_TIMEOUT_S} s (is the Slurm controller up?)") from None
    except OSError as exc:
        raise ConfigError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None


def slurm_failure(run: subprocess.CompletedProcess) -> ConfigError:
    return ConfigError(f"{run.args[0]} failed: {slurm_message(run.stderr) or f'exit status {run.returncode}'}")


def slurm_message(text: str) -> str:
    """The line of a Slurm command's stderr that says what went wrong: its first error line,
    else its first line ("" when it said nothing)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")


def partition_nodes(partition: str | None) -> tuple[int, int] | None:
    """(CPUs, memory in MiB) of the smallest node of `partition` (None: the default one), by
    sinfo; None where sinfo cannot say (not installed, no answer, no such partition)."""
    cmd = ["sinfo", "--noheader", "--format=%c %m %P", *([f"--partition={partition}"] if partition else [])]
    try:
        shown = run_slurm(cmd)
    except ConfigError:
        return None
    if shown.returncode != 0:
        return None
    sizes = []
    for line in shown.stdout.splitlines():
        cpus, mem, name = (line.split() + ["", "", ""])[:3]
        if partition is None and not name.endswith("*"):  # the default partition is starred
            continue
        cpus, mem = digits(cpus.rstrip("+")), digits(mem.rstrip("+"))  # "64+": nodes of that many or more
        if cpus is not None and mem is not None:
            sizes.append((cpus, mem))
    return (min(c for c, _ in sizes), min(m for _, m in sizes)) if sizes else None
