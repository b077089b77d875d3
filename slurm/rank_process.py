"""What a local rank's process sets up for itself before it joins (slurm/launchers/processes.py spawns it):
a process session of its own, its end with the launcher's, its compute threads, its log file."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from basics.user_files import digits


def own_session() -> None:
    """This rank in a process session of its own, as torchrun starts its workers: where the
    kernel groups CPU time by session (autogroup), each rank then gets its own share instead of
    all of them splitting the launching shell's one. Ctrl-C reaches the supervisor only, which
    stops the ranks; its death stops them too (`die_with_parent`)."""
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()


def rank_threads(world_size: int, environ=os.environ) -> int:
    """Compute threads per local rank: OMP_NUM_THREADS where set (as torchrun honours it), else
    this process's usable cores (its affinity: a Slurm step's or taskset's, not the machine's)
    shared among the ranks."""
    given = digits(environ.get("OMP_NUM_THREADS"))
    if given is not None and given > 0:
        return given
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def die_with_parent() -> None:
    """Linux: SIGTERM this rank if the supervisor dies (no orphans holding GPUs or ports)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def redirect_output(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout, sys.stderr = _LenientLog(sys.stdout), _LenientLog(sys.stderr)


class _LenientLog:
    """A rank's stdout or stderr (its log file) that drops what it cannot write: on a full disk a
    progress bar or a warning must not fail the rank (and read as a model that does not load);
    the outputs' own writes report the disk (runtime/video.py)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)
