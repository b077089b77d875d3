"""Heartbeats of ranks on other hosts (sbatch jobs, srun steps), kept in the output folder, and
the launcher's watch over them.

A rank that is stopped (SIGSTOP, a frozen node) says nothing and does not exit; its peers
only time out, and while they wait on the writer (it decodes and writes a video) they do so
under the setup timeout, half an hour by default. Local ranks beat into shared memory
(slurm/local.py); a Slurm rank's thread writes an increasing count into a file of its job's
folder on the shared file system, fsynced so that other hosts see it. The launcher (which
follows its jobs) ends a job whose rank's count has not moved for longer than the step
timeout, naming that rank, and the supervisor retries it as any failure. A rank that returns
removes its file: a finished rank is not a stopped one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

BEAT_S = 2.0  # how often a rank writes its count
# Never stale sooner than this: a shared file system shows a write to other hosts late.
MIN_STALE_S = 15.0


class Heartbeat:
    """The beating of one rank into `folder/rank-<rank>` (a thread; `stop()` removes the file)."""

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._stopped = threading.Event()
        threading.Thread(target=self._beat, name="ditango-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        count = 0
        while not self._stopped.is_set():
            count += 1
            # In place, a fixed width: no new block to allocate, so a full disk does not stop it.
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, b"%020d\n" % count, 0)
                os.fsync(self._fd)
            self._stopped.wait(BEAT_S)

    def stop(self) -> None:
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

    def stale(self, after_s: float) -> tuple[int, float] | None:
        """(rank, seconds) of the rank whose count has stood still longest, when that is longer
        than `after_s` (at least MIN_STALE_S); else None."""
        now = time.monotonic()
        for path in self.folder.glob("rank-*"):
            try:
                rank, count = int(path.name.removeprefix("rank-")), path.read_bytes()
            except (OSError, ValueError):
                continue
            if self._seen.get(rank, (None,))[0] != count:
                self._seen[rank] = (count, now)
        for rank in [r for r in self._seen if not (self.folder / f"rank-{r}").exists()]:
            del self._seen[rank]  # returned: not stopped
        ages = sorted(((now - at, rank) for rank, (_, at) in self._seen.items()), reverse=True)
        if ages and ages[0][0] > max(after_s, MIN_STALE_S):
            return ages[0][1], ages[0][0]
        return None


def stopped_message(seconds: float) -> str:
    return f"stopped answering (no heartbeat for {seconds:.0f} s: a stopped process, e.g. SIGSTOP)"
