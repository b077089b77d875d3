"""Heartbeats of ranks on other hosts (sbatch jobs, srun steps), kept in the output folder, and
the launcher's watch over them.

A rank that is stopped (SIGSTOP, a frozen node) says nothing and does not exit; its peers
only time out, and while they wait on the writer (it decodes and writes a video) they do so
under the setup timeout, half an hour by default. Local ranks beat into shared memory
(slurm/launchers/processes.py); a Slurm rank's thread writes an increasing count into a file of its job's
folder on the shared file system, fsynced so that other hosts see it, with the Slurm step it
belongs to. The launcher (which follows its jobs) kills that step (SIGKILL: Slurm's own
cancel sends SIGCONT first, and the stopped rank would go on) when a rank's count has not
moved for longer than the step timeout, names that rank, and the supervisor retries it as
any failure. A rank that returns removes its file: a finished rank is not a stopped one.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path

from basics.errors import ConfigError
from slurm.jobs import run_slurm

BEAT_S = 2.0  # how often a rank writes its count
# Never stale sooner than this: a shared file system shows a write to other hosts late.
MIN_STALE_S = 15.0


class Heartbeat:
    """The beating of one rank into `folder/rank-<rank>` (a thread; `stop()` removes the file).
    Where the file cannot be made (a full disk) the rank runs without one: nothing watches it."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"rank-{rank}"
        job, step = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_STEP_ID", "")
        self._step = (f"{job}.{step}" if job and step else job).encode()
        self._stopped = threading.Event()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            self._stopped.set()
            return
        threading.Thread(target=self._beat, name="ditango-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        count = 0
        while not self._stopped.is_set():
            count += 1
            # In place, a fixed width: no new block to allocate, so a full disk does not stop it.
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, b"%020d %s\n" % (count, self._step), 0)
                os.fsync(self._fd)
            self._stopped.wait(BEAT_S)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            self.path.unlink()


class BeatWatch:
    """What a launcher knows of the heartbeats in `folder`: each rank's last count, and when (by
    this host's clock) it last saw it change. Ranks count from their first beat seen."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._seen: dict[int, tuple[bytes, float]] = {}

    def reset(self) -> None:
        """Forget what was seen (the job is not running: its next attempt counts afresh)."""
        self._seen.clear()

    def stale(self, after_s: float) -> tuple[int, float, str] | None:
        """(rank, seconds, its Slurm step) of the rank whose count has stood still longest, when
        that is longer than `after_s` (at least MIN_STALE_S); else None."""
        now, present = time.monotonic(), set()
        for path in self.folder.glob("rank-*"):
            try:
                rank, count = int(path.name.removeprefix("rank-")), path.read_bytes()
            except (OSError, ValueError):
                continue
            present.add(rank)
            if self._seen.get(rank, (None,))[0] != count:
                self._seen[rank] = (count, now)
        for rank in set(self._seen) - present:
            del self._seen[rank]  # returned: not stopped
        ages = sorted(((now - at, rank) for rank, (_, at) in self._seen.items()), reverse=True)
        if ages and ages[0][0] > max(after_s, MIN_STALE_S):
            seconds, rank = ages[0]
            step = self._seen[rank][0].decode("ascii", "replace").split()
            return rank, seconds, step[1] if len(step) > 1 else ""
        return None


def kill_step(step: str) -> bool:
    """SIGKILL the tasks of a Slurm step ("<job>.<step>"), a stopped one included; whether Slurm
    took the request."""
    if not _STEP.fullmatch(step):
        return False
    try:
        return run_slurm(["scancel", "--signal=KILL", step]).returncode == 0
    except ConfigError:
        return False


_STEP = re.compile(r"[0-9]+(\.[0-9]+)?")


def stopped_message(seconds: float) -> str:
    return f"stopped answering (no heartbeat for {seconds:.0f} s: a stopped process, e.g. SIGSTOP)"


def stopped_failure(rank: int, seconds: float, log: Path) -> tuple[str, int]:
    """(error, rank) of a launch ended because `rank` stood still, as the supervisor takes it."""
    return f"rank {rank} failed: {stopped_message(seconds)} (log: {log})", rank
