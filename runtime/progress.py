"""Progress where no terminal draws a bar: plain timestamped log lines (`LogObserver`: Slurm
logs, nohup, `| tee`) and the writer's heartbeat file OUT/.ditango/progress/<report>.json
(`ProgressFile`), which `ditango status` reads. Both take their numbers from `Pace`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from basics.errors import ConfigError
from basics.user_files import printable, read_json_file
from runtime.config import Item
from runtime.context import Observer
from runtime.outputs import state_dir
from runtime.pace import Pace, duration, progress_text
from runtime.record_shape import HEARTBEAT, a_pid

HEARTBEAT_EVERY_S = 2.0  # the heartbeat file is rewritten at most this often while steps come
PROGRESS_DIR = "progress"  # in OUT/.ditango/: one file per task or replica report


def stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class LogObserver:
    """Progress as plain lines on `stream` (stderr by default), each with a UTC time stamp: one
    when an item starts and ends, and during its steps one at least every 10% of them and at
    most 30 s apart (`Pace.step_done`). A context manager, as the rich observer is."""

    def __init__(self, stream: TextIO | None = None, pace: Pace | None = None) -> None:
        self.stream = stream
        self.pace = pace or Pace()

    def __enter__(self) -> LogObserver:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _line(self, text: str, stamped: bool = True) -> None:
        stream = self.stream or sys.stderr
        text = printable(text)  # errors hold what files and users gave: shown, never acted on
        with contextlib.suppress(OSError, ValueError):  # a closed or full log never fails the run
            stream.write(f"{stamp()} {text}\n" if stamped else f"{text}\n")
            stream.flush()

    def _item(self) -> str:
        p = self.pace
        return f"item {p.index}/{p.items} {p.item}"

    def run_started(self, total: int) -> None:
        # No line yet: the model loads next, and a model that does not load is one error line.
        self.pace.run_started(total)

    def item_started(self, item: Item) -> None:
        self.pace.item_started(item.id, item.steps)
        self._line(f"{self._item()}: started ({item.steps} steps)")

    def step_done(self, step: int, steps: int) -> None:
        if self.pace.step_done(step, steps):
            self._line(progress_text(self.pace.snapshot()))

    def phase(self, name: str) -> None:
        self.pace.set_phase(name)
        self._line(f"{self._item()}: {name}")

    def item_finished(self, record: dict) -> None:
        took = self.pace.item_finished()
        head = self._item()
        if record.get("status") == "failed":
            self._line(f"{head}: failed after {duration(took)}: {record.get('error')}")
            return
        left = self.pace.items - self.pace.index
        eta = self.pace.eta_batch_s if left else None
        after = f", {left} left, ETA batch {duration(eta)}" if eta is not None else ""
        self._line(f"{head}: done in {took:.1f} s -> {record.get('video')}{after}")

    def message(self, text: str) -> None:
        # As on a terminal: the supervisor's notes (skipped items, a retry) read the same in a log.
        self._line(text, stamped=False)


def progress_path(out_dir: Path, report_name: str) -> Path:
    """The heartbeat file of the run that writes `report_name` (report.json, a task's or a
    replica's report): one per writer, so array tasks and replicas do not overwrite each other."""
    return state_dir(out_dir) / PROGRESS_DIR / Path(report_name).name


class ProgressFile:
    """The writer's observer: every call goes on to `inner`, and the heartbeat file at `path`
    says where the run is (`Pace.snapshot()`, plus state, wall-clock time of the update, host
    and pid). Rewritten atomically (temp file, os.replace) at every item's start, phase and end,
    and at most every `every_s` seconds between steps. A write that fails (a full disk, a
    read-only folder) is skipped: the heartbeat never fails the run."""

    def __init__(self, inner: Observer, path: Path, pace: Pace | None = None, every_s: float = HEARTBEAT_EVERY_S):
        self.inner, self.path, self.every_s = inner, path, every_s
        self.pace = pace or Pace()
        self._written = -float("inf")
        self.counts = {"done": 0, "failed": 0}

    def write(self, state: str = "running") -> None:
        self._written = self.pace.clock()
        data = {
            "state": state,
            "updated": time.time(),
            "updated_at": stamp(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **self.pace.snapshot(),
            **self.counts,
        }
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
            tmp = None
        except OSError:
            pass
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def finish(self) -> None:
        """The run ended (every item generated or given up): the file says so."""
        self.write("finished")

    def run_started(self, total: int) -> None:
        self.pace.run_started(total)
        self.write()
        self.inner.run_started(total)

    def item_started(self, item: Item) -> None:
        self.pace.item_started(item.id, item.steps)
        self.write()
        self.inner.item_started(item)

    def step_done(self, step: int, steps: int) -> None:
        self.pace.step_done(step, steps)
        if self.pace.clock() - self._written >= self.every_s or step >= steps:
            self.write()
        self.inner.step_done(step, steps)

    def phase(self, name: str) -> None:
        self.pace.set_phase(name)
        self.write()
        self.inner.phase(name)

    def item_finished(self, record: dict) -> None:
        self.pace.item_finished()
        status = record.get("status")
        if status in self.counts:
            self.counts[status] += 1
        self.write()
        self.inner.item_finished(record)

    def message(self, text: str) -> None:
        self.inner.message(text)


def read_progress(out_dir: Path) -> list[tuple[str, dict]]:
    """(name, heartbeat) of every readable heartbeat file in `out_dir` (a torn or foreign one is
    left out: it is only a progress view)."""
    found = []
    for path in sorted((state_dir(out_dir) / PROGRESS_DIR).glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            data = read_json_file(path, "heartbeat", 2**20)
        except (OSError, ConfigError):  # torn, foreign, not a file: only a progress view
            continue
        if HEARTBEAT(data):
            found.append((path.stem, data))
    return found


def _gone(data: dict) -> bool:
    """Whether the writer of a heartbeat was a process of this host that no longer runs (one
    on another host cannot be asked: its file's age tells)."""
    pid = data.get("pid")
    if data.get("host") != socket.gethostname() or not a_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def heartbeat_line(data: dict, now: float | None = None) -> str:
    """'item 2/5 a: step 8/20, 1.93 s/step, ETA item 23 s, batch 2m41s (updated 4 s ago)'."""
    age = f"updated {duration((now or time.time()) - data['updated'])} ago"
    counts = f"{data.get('done', 0)} done, {data.get('failed', 0)} failed"
    if data["state"] == "running" and _gone(data):  # killed before it could say so
        return f"stopped: its process (pid {data.get('pid')}) is gone; {counts} ({age})"
    if data["state"] != "running":
        return f"{data['state']}: {counts} ({age})"
    try:
        where = progress_text(data) if data.get("item_index") else "starting"
    except (KeyError, TypeError, ValueError, OverflowError):  # a field of another type: the state only
        where = "running"
    return f"running: {where}; {counts} ({age}, host {data.get('host')} pid {data.get('pid')})"
