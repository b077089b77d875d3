"""One work queue per output folder: every replica of every launch (local processes, srun steps,
sbatch jobs and arrays, torchrun, a `--join`) takes its next item from it.

    OUT/.ditango/queue/batch.json        the batch: its id, items longest first, settings
    OUT/.ditango/queue/<batch>/items/<id>/1, 2, ...   the item's history, one file per event
    OUT/.ditango/queue/<batch>/workers/<worker>.json  each worker's own state (`ditango status`)
    OUT/.ditango/queue/<batch>/staging/<id>.<n>/      the files of lease n, before they publish

An item's history is a sequence of files, each created exclusively (runtime/queue_files.py):
`lease` (a worker claims it: the file's number is the lease's fencing token; the holder renews
its mtime), `done` (lease n published), `failed` (lease n failed; `final`: given up). The last
file says where the item is, and taking the next number is the only way to change it, so two
workers racing (a claim against a claim, a takeover against the late holder's publication)
cannot both win: whoever creates file n+1 first decides. A lease whose file was not renewed
for `lease_s` (its worker killed, stopped, preempted, its node lost), or whose process on this
host is gone, is taken over by the next worker that looks; its holder can never publish then,
since publishing is creating file n+1 too. A late holder's files are discarded and logged,
never counted. Attempts are the item's leases, over every worker: an item is given up once
`retries` + 1 of them failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from runtime.lock import _alive, _start_time
from runtime.outputs import state_dir
from runtime.queue_files import (
    create_exclusive,
    fs_now,
    fsync_folder,
    make_folder,
    numbered,
    read_json_file,
    replace_json,
    touch,
)

QUEUE_DIR = "queue"
LEASE_S = 60.0  # --lease: a lease not renewed for this long is taken over
POLL_S = 1.0  # how often an idle worker looks again while others hold the last items


def queue_dir(out_dir: Path) -> Path:
    return state_dir(out_dir) / QUEUE_DIR


def manifest_path(out_dir: Path) -> Path:
    return queue_dir(out_dir) / "batch.json"


def now_text() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Worker:
    """Who holds a lease: a replica's leader process, and what launched it (`launch`: the
    launch's key, which the supervisor uses to break the leases of a launch it saw fail; `job`:
    the Slurm job, as submitit names it)."""

    id: str
    label: str
    host: str
    pid: int
    pid_start: int | None = None
    launch: str = ""
    job: str = ""

    @classmethod
    def here(cls, label: str, launch: str = "") -> Worker:
        pid = os.getpid()
        return cls(
            f"{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:6]}",
            label,
            socket.gethostname(),
            pid,
            _start_time(pid),
            launch,
            slurm_job(),
        )

    def to_json(self) -> dict:
        return {
            "worker": self.id,
            "label": self.label,
            "host": self.host,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "launch": self.launch,
            "job": self.job,
        }


def slurm_job() -> str:
    """This process's Slurm job as submitit and sacct name it ("123", or "123_4" in an array)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


@dataclass(frozen=True)
class Lease:
    """Lease `token` on `item` (the number of its history file)."""

    item: str
    token: int
    path: Path


@dataclass
class ItemState:
    """An item's history as it reads now: `kind` pending, leased, expired, retry, done or failed."""

    kind: str
    last: int = 0  # the number of its last file (0: none)
    data: dict = field(default_factory=dict)  # the last file's content
    leases: int = 0  # attempts so far
    age_s: float = 0.0  # of the last file
    why: str = ""  # why an expired lease is taken for one


def _dead_here(data: dict) -> bool:
    """Whether a lease's worker is a process of this host that is gone (no need to wait)."""
    pid = data.get("pid")
    return data.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid, data.get("pid_start"))


class BatchQueue:
    """The queue of batch `batch` in `out_dir` (see the module doc)."""

    def __init__(self, out_dir: Path, manifest: dict) -> None:
        self.out_dir, self.manifest = out_dir, manifest
        self.batch: str = manifest["batch"]
        self.lease_s: float = float(manifest.get("lease_s", LEASE_S))
        self.retries: int = int(manifest.get("retries", 1))
        self.order: list[str] = [e["id"] for e in manifest["items"] if not e.get("skipped")]
        self.root = queue_dir(out_dir) / self.batch
        self._settled: set[str] = set()

    # -- paths --------------------------------------------------------------------------
    def item_dir(self, item: str) -> Path:
        return self.root / "items" / item

    def stage(self, lease: Lease) -> Path:
        return self.root / "staging" / f"{lease.item}.{lease.token}"

    def worker_file(self, worker: str) -> Path:
        return self.root / "workers" / f"{worker}.json"

    def current(self) -> bool:
        """Whether this batch is still the folder's (a new command may have begun another)."""
        found = read_json_file(manifest_path(self.out_dir))
        return found is not None and found.get("batch") == self.batch

    # -- reading ------------------------------------------------------------------------
    def state(self, item: str, now: float | None = None) -> ItemState:
        folder = self.item_dir(item)
        numbers = numbered(folder)
        if not numbers:
            return ItemState("pending")
        last = numbers[-1]
        path = folder / str(last)
        data = read_json_file(path) or {}
        leases = sum(1 for n in numbers if (read_json_file(folder / str(n)) or {}).get("kind") == "lease")
        try:
            age = (fs_now(self.root) if now is None else now) - path.stat().st_mtime
        except FileNotFoundError:
            age = 0.0
        kind = data.get("kind")
        if kind == "done":
            return ItemState("done", last, data, leases, age)
        if kind == "failed":
            return ItemState("failed" if data.get("final") else "retry", last, data, leases, age)
        if kind != "lease":  # unreadable, or of another kind: waited out as a lease would be
            if age <= self.lease_s:
                return ItemState("leased", last, data, leases, age)
            return ItemState("expired", last, data, leases, age, f"its last record ({path.name}) cannot be read")
        if _dead_here(data):
            why = f"its worker, pid {data.get('pid')} on {data.get('host')}, is gone"
            return ItemState("expired", last, data, leases, age, why)
        if age > self.lease_s:
            why = f"its worker, {data.get('label') or data.get('worker')}, did not renew it for {age:.0f} s"
            return ItemState("expired", last, data, leases, age, why)
        return ItemState("leased", last, data, leases, age)

    def states(self) -> dict[str, ItemState]:
        now = fs_now(self.root)
        return {item: self.state(item, now) for item in self.order}

    def settled(self, item: str, now: float | None = None) -> bool:
        if item in self._settled:
            return True
        if self.state(item, now).kind in ("done", "failed"):
            self._settled.add(item)
            return True
        return False

    # -- changing: each a file n + 1, created exclusively -------------------------------
    def _next(self, item: str, last: int, data: dict) -> Path | None:
        folder = self.item_dir(item)
        make_folder(folder)
        path = folder / str(last + 1)
        return path if create_exclusive(path, {**data, "at": now_text()}) else None

    def claim(self, worker: Worker, on_given_up=None) -> Lease | str:
        """The next item in order this worker may take: a new lease on it, or "wait" (others
        hold what is left) or "end" (every item is settled). An expired lease is taken over;
        one whose item used up its attempts is given up instead (`on_given_up(item, record,
        attempts)`, once the failure is recorded in the history)."""
        waiting = False
        for item in self.order:
            while not self.settled(item, now := fs_now(self.root)):
                st = self.state(item, now)
                if st.kind == "leased":
                    waiting = True
                    break
                if st.kind in ("expired", "retry") and st.leases > self.retries:
                    why = st.why or st.data.get("error") or "failed"
                    record = {
                        "kind": "failed",
                        "lease": st.last if st.kind == "expired" else st.data.get("lease"),
                        "error": f"lease {st.last} lost: {why}" if st.kind == "expired" else why,
                        "final": True,
                        "recorded_by": worker.id,
                    }
                    if self._next(item, st.last, record) is not None and on_given_up is not None:
                        on_given_up(item, record, st.leases)
                    continue
                lease = {"kind": "lease", **worker.to_json()}
                if st.kind == "expired":
                    lease["took_over"] = {"lease": st.last, "why": st.why}
                path = self._next(item, st.last, lease)
                if path is not None:
                    return Lease(item, st.last + 1, path)
        return "wait" if waiting else "end"

    def holds(self, lease: Lease) -> bool:
        """Whether `lease` is still the item's last word (nobody took it over)."""
        return not (self.item_dir(lease.item) / str(lease.token + 1)).exists()

    def renew(self, lease: Lease) -> bool:
        return self.holds(lease) and touch(lease.path)

    def publish(self, lease: Lease, record: dict) -> bool:
        """Make lease's staged files the item's outputs, if it still holds: the decision is the
        creation of file token + 1 ("done"); then each file moves into OUT, the sidecar last.
        False (nothing moved) when another worker took the item over."""
        done = {
            "kind": "done",
            "lease": lease.token,
            "worker": (record.get("queue") or {}).get("worker"),
            "video_sha256": record.get("video_sha256"),
        }
        if self._next(lease.item, lease.token, done) is None:
            return False
        self.finish_publishing(lease)
        return True

    def finish_publishing(self, lease: Lease) -> None:
        """Move what is left of a published lease's staged files into OUT (sidecar last). A
        reader that finds a "done" whose writer died halfway calls it too; rename is atomic, and
        a file two movers race for is moved once."""
        stage = self.stage(lease)
        try:
            names = sorted(os.listdir(stage), key=lambda n: n == f"{lease.item}.json")
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith("."):  # a writer's partial file: not an output
                continue
            with contextlib.suppress(FileNotFoundError):
                os.replace(stage / name, self.out_dir / name)
        fsync_folder(self.out_dir)
        shutil.rmtree(stage, ignore_errors=True)

    def fail(self, lease: Lease, error: str, final: bool, by: str) -> tuple[bool, bool]:
        """Record lease's attempt failed: (recorded, given up). Not recorded when the lease was
        already taken over (its attempt was counted then). Given up when `final` (a failure that
        would happen again) or when the item used its retries."""
        st = self.state(lease.item)
        final = final or st.leases > self.retries
        record = {"kind": "failed", "lease": lease.token, "error": error, "final": final, "recorded_by": by}
        recorded = self._next(lease.item, lease.token, record) is not None
        return recorded, final and recorded

    def discard(self, lease: Lease, worker: Worker) -> str:
        """A late holder's staged files go; a line says so (kept in the batch's `discarded`)."""
        holder = read_json_file(self.item_dir(lease.item) / str(lease.token + 1)) or {}
        line = (
            f"{lease.item}: lease {lease.token} of {worker.label} was taken over "
            f"({holder.get('kind', '?')} {lease.token + 1} by {holder.get('label') or holder.get('worker') or '?'}); "
            "its late files are discarded"
        )
        shutil.rmtree(self.stage(lease), ignore_errors=True)
        folder = self.root / "discarded"
        make_folder(folder)
        replace_json(
            folder / f"{lease.item}.{lease.token}.json",
            {"item": lease.item, "lease": lease.token, **worker.to_json(), "line": line, "at": now_text()},
        )
        return line

    def leases_of(self, match) -> list[Lease]:
        """The live leases (an item's last word) whose file's content `match(data)` accepts."""
        found = []
        for item in self.order:
            numbers = numbered(self.item_dir(item))
            if numbers:
                path = self.item_dir(item) / str(numbers[-1])
                data = read_json_file(path) or {}
                if data.get("kind") == "lease" and match(data):
                    found.append(Lease(item, numbers[-1], path))
        return found

    def failures_since(self, since: float) -> list[tuple[str, dict, int]]:
        """(item, failure, attempts then) of each failure recorded at or after `since` (fs time)."""
        found = []
        for item in self.order:
            folder, leases = self.item_dir(item), 0
            for n in numbered(folder):
                data = read_json_file(folder / str(n)) or {}
                leases += data.get("kind") == "lease"
                with contextlib.suppress(FileNotFoundError):
                    if data.get("kind") == "failed" and (folder / str(n)).stat().st_mtime >= since:
                        found.append((item, data, leases))
        return found

    def left(self) -> list[str]:
        """Items not settled (pending, leased, to retry)."""
        return [i for i in self.order if not self.settled(i)]

    def live_leases(self) -> list[tuple[str, dict]]:
        """(item, lease) of every lease not expired: workers at work on this batch now."""
        return [(i, s.data) for i, s in self.states().items() if s.kind == "leased" and s.data.get("kind") == "lease"]


def wait_s(lease_s: float) -> float:
    """How long an idle worker sleeps before it looks again."""
    return min(POLL_S, lease_s / 4)


def renew_every(lease_s: float) -> float:
    """How often a holder renews: four times a lease, so a slow file server's hiccup is no loss."""
    return lease_s / 4


def sleep_idle(lease_s: float) -> None:
    time.sleep(wait_s(lease_s))
