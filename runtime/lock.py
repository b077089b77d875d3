"""One owner per output folder: the lock `OUT/.ditango/lock`.

A command that writes into OUT (`generate`, for its whole run: every launch, retry and
relaunch) holds the lock; a second one into the same OUT refuses, or waits with
`--wait-for-lock`. The lock is a file naming its owner (host, pid, start, command), created
atomically with its content, and kept fresh by a heartbeat (its mtime, every `BEAT_S`). A
run that dies without releasing it does not hold it forever: the next one takes it over when
the owner's process is gone (same host: a live owner holds it even when stopped, and a pid
reused by another process does not count) or, from another host, when its heartbeat is older
than `LEASE_S` (by the folder's file-system clock, so it works on a shared file system).

Jobs submitted without `--wait` outlive the command that submitted them; while they are
live, OUT belongs to them (the CLI asks Slurm about the jobs in `jobs.json`, see slurm/jobs.py).

Once OUT is owned (and no submitted job is live), `remove_partials` deletes the partial
files a killed writer left behind (`.<name>.partial-<pid>.<ext>`, see runtime/video.py): no
writer of this tool is left to finish them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import digits, read_text
from runtime.out_folder import check_bookkeeping
from runtime.outputs import check_foreign_files, fs_clock, state_dir
from runtime.record_shape import a_pid
from runtime.video import PARTIAL_GLOB

BEAT_S = 15.0  # how often the owner refreshes the lock's mtime
LEASE_S = 120.0  # a lock not refreshed for this long is stale (its owner is gone or frozen)
WRITING_S = 10.0  # an unreadable lock younger than this may be one still being written


class FolderBusy(ConfigError):
    """OUT has another owner (a run, or live Slurm jobs)."""


def owner_line(owner: dict) -> str:
    return f"pid {owner.get('pid')} on {owner.get('host')} (since {owner.get('started_at')}: {owner.get('command')})"


class FolderLock:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = state_dir(out_dir) / "lock"
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- what is there now ---------------------------------------------------------------
    def holder(self) -> tuple[dict | None, str | None]:
        """(owner, None) when a live owner holds OUT; (owner or None, why) when the lock is
        stale (why it may be taken over); (None, None) when there is no lock."""
        try:  # bounded, a regular file only: a FIFO or a huge file put there reads as damaged
            raw = read_text(self.path, "lock", 2**16)
            age = fs_clock(self.out_dir) - self.path.stat().st_mtime
        except FileNotFoundError:
            return None, None
        except (OSError, ConfigError):
            raw, age = "", LEASE_S + 1
        try:
            owner = json.loads(raw)
            owner = owner if isinstance(owner, dict) else None
        except (ValueError, RecursionError):
            owner = None
        if owner is None:
            return None, (None if age < WRITING_S else "the lock file is damaged")
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            if not _alive(owner["pid"], owner.get("pid_start")):
                return owner, f"its owner, {owner_line(owner)}, is gone"
            return owner, None  # alive on this host: it owns OUT, even stopped (its heartbeat then lags)
        if age > LEASE_S:
            return owner, f"its owner, {owner_line(owner)}, has not refreshed it for {age:.0f} s"
        return owner, None

    def busy(self, owner: dict) -> FolderBusy:
        return FolderBusy(
            f"{self.out_dir} is in use by {owner_line(owner)}; wait for it to end, or pass --wait-for-lock"
        )

    def check_free(self) -> None:
        """Raise FolderBusy when a live owner holds OUT (what `acquire` would refuse)."""
        owner, stale = self.holder()
        if owner is not None and stale is None:
            raise self.busy(owner)

    # -- taking and giving back ----------------------------------------------------------
    def acquire(self, wait: bool = False, say: Callable[[str], None] = print, poll_s: float = 2.0) -> FolderLock:
        """Own OUT, or raise FolderBusy (wait: until the owner is done)."""
        check_bookkeeping(self.out_dir)  # `.ditango` a file, the lock a FIFO: one line, before any read
        check_foreign_files(self.out_dir)
        state_dir(self.out_dir).mkdir(parents=True, exist_ok=True)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _start_time(os.getpid()),
            "token": self.token,
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(" ".join(["ditango", *sys.argv[1:]]).split())[:300],  # one line
        }
        try:
            self._take(me, wait, say, poll_s)
        except OSError as exc:
            raise ConfigError(f"cannot take {self.path}: {exc.strerror or exc}") from None
        self._beat = threading.Thread(target=self._heartbeat, name="ditango-lock", daemon=True)
        self._beat.start()
        return self

    def _take(self, me: dict, wait: bool, say: Callable[[str], None], poll_s: float) -> None:
        waiting = False
        while not self._create(me):
            owner, stale = self.holder()
            if stale is not None:
                say(f"note: taking over {self.out_dir}: {stale}")
                self._break(owner)
                continue
            if owner is None:  # released (or being written) just now: try again
                time.sleep(0.1)
                continue
            if not wait:
                raise self.busy(owner)
            if not waiting:
                say(f"waiting for {self.out_dir}: in use by {owner_line(owner)}")
                waiting = True
            time.sleep(poll_s)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self._ours():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _create(self, me: dict) -> bool:
        """Create the lock with its content in one step (a hard link of a complete file fails
        if the lock exists): nobody ever reads a half-written lock of ours."""
        tmp = self.path.with_name(f".lock.{self.token}")
        tmp.write_text(json.dumps(me) + "\n", encoding="utf-8")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: exclusive create instead
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(me) + "\n")
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _break(self, stale: dict | None) -> None:
        """Remove a stale lock, unless another run took it over between our look and now
        (then put theirs back)."""
        aside = self.path.with_name(f".lock.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _owner_in(aside)
        if stale is not None and isinstance(moved, dict) and moved.get("token") != stale.get("token"):
            try:  # a fresh lock: give it back (fails only if yet another run holds OUT now)
                os.link(aside, self.path)
            except OSError:
                pass
        with contextlib.suppress(OSError):  # what is not a file is left aside, out of the lock's way
            aside.unlink(missing_ok=True)

    def _ours(self) -> bool:
        owner = _owner_in(self.path)
        return owner is not None and owner.get("token") == self.token

    def _heartbeat(self) -> None:
        while not self._stop.wait(BEAT_S):
            if self._ours():
                try:
                    os.utime(self.path)
                except OSError:
                    pass


def _owner_in(path: Path) -> dict | None:
    """The owner a lock file names, None when it cannot say: read bounded and only if it is a
    regular file (a FIFO put there would block the read for ever)."""
    try:
        owner = json.loads(read_text(path, "lock", 2**16))
    except (OSError, ValueError, RecursionError):  # ConfigError is a ValueError: not a regular file, not text
        return None
    return owner if isinstance(owner, dict) else None


def _alive(pid: int, started: int | None = None) -> bool:
    """Whether process `pid` runs, and is the one that started at `started` (a pid the
    system gave to another process since is not the owner). A pid no process can have (0, -1:
    process groups to os.kill) is no owner."""
    if not a_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    now = _start_time(pid)
    return started is None or now is None or now == started


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None
    where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return digits(fields[19]) if len(fields) > 19 else None


def remove_partials(out_dir: Path) -> list[Path]:
    """Remove the partial files killed writers left in OUT (and its bookkeeping folder)."""
    removed = []
    for folder in (out_dir, state_dir(out_dir), state_dir(out_dir) / "reports"):
        for path in folder.glob(PARTIAL_GLOB):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed
