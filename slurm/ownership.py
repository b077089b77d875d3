"""The output folder's ownership for a run's whole length: one run writes a folder at a time
(runtime/lock.py), and no run takes a folder that live Slurm jobs still write (slurm/jobs.py).
The CLI takes the folder with `own_output_folder`, then hands the executor
(slurm/launchers/) to the supervisor (slurm/supervise.py)."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path

from runtime.lock import FolderBusy, FolderLock, remove_partials
from runtime.outputs import check_foreign_files
from slurm.jobs import live_jobs


def own_output_folder(out_dir: Path, wait: bool, say: Callable[[str], None], poll_s: float = 30.0) -> FolderLock:
    """The lock on OUT for a command's whole run (runtime/lock.py), once no Slurm job
    submitted from OUT is still live (such jobs own OUT until they end); then the partial
    files of killed writers go. `wait`: wait for the owner instead of refusing."""
    lock = FolderLock(out_dir).acquire(wait, say)
    waiting = False
    while live := live_jobs(out_dir):
        if not wait:
            lock.release()
            raise _owned_by_jobs(out_dir, live)
        if not waiting:
            say(f"waiting for Slurm job(s) {_listed(live)}, submitted from {out_dir}, to end")
            waiting = True
        time.sleep(poll_s)
    for path in remove_partials(out_dir):
        say(f"note: removed {path.name}, left by a writer that was killed")
    return lock


def check_output_folder_free(out_dir: Path) -> None:
    """Raise what `generate` would when OUT is not its to write: a foreign report.json in it,
    or another run or live jobs own it (FolderBusy)."""
    if not out_dir.is_dir():
        return
    check_foreign_files(out_dir)  # a report.json this tool did not write would be replaced
    FolderLock(out_dir).check_free()
    if live := live_jobs(out_dir):
        raise _owned_by_jobs(out_dir, live)


def _listed(live: list[tuple[str, str]]) -> str:
    return ", ".join(f"{job} ({state})" for job, state in live)


def _owned_by_jobs(out_dir: Path, live: list[tuple[str, str]]) -> FolderBusy:
    return FolderBusy(
        f"{out_dir} belongs to Slurm job(s) {_listed(live)} submitted from it; wait for them to end, "
        f"`ditango cancel {shlex.quote(str(out_dir))}`, or pass --wait-for-lock"
    )
