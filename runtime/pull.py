"""Where a replica's items come from and where its files go: `StaticWork`, the items of its
round-robin share in order, written straight into OUT (--queue static); `QueueWork`, the next
item of the output folder's queue (runtime/batch_queue.py), claimed by the replica's writer and
told to its ranks, its files staged and published only while the writer still holds the lease.

The writer's `LeaseKeeper` thread renews the lease it holds (a stopped or killed process renews
nothing: its lease runs out and another worker takes the item over) and keeps its worker file,
which `ditango status` reads.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from basics.errors import ConfigError
from runtime.batch_queue import BatchQueue, Lease, Worker, manifest_path, now_text, renew_every, sleep_idle
from runtime.config import Item, RunConfig
from runtime.context import Observer, RankContext
from runtime.outputs import mark_running, record_failure
from runtime.queue_files import make_folder, read_json_file, replace_json
from runtime.writer import write_item

BROADCAST_S = 5.0  # an idle writer tells its ranks to wait at least this often (their collectives time out)


class StaticWork:
    """The items in order; each written into OUT directly, its sidecar marking it running first."""

    def __init__(self, cfg: RunConfig, todo: list[Item]) -> None:
        self.cfg, self.todo = cfg, todo

    def __iter__(self) -> Iterator[Item]:
        return iter(self.todo)

    def begin(self, cfg: RunConfig, item: Item) -> None:
        mark_running(cfg, item)

    def write(self, cfg: RunConfig, item: Item, *args, **kwargs) -> dict | None:
        return write_item(cfg, item, *args, **kwargs)

    def fail(self, cfg: RunConfig, item: Item, error: str, final: bool) -> dict | None:
        return record_failure(cfg, item, error, 1, final=final)

    def close(self, state: str) -> None:
        return None


def open_batch(cfg: RunConfig) -> BatchQueue:
    """The queue of the batch this run's launcher began (it may have been replaced since)."""
    manifest = read_json_file(manifest_path(cfg.out_dir))
    if manifest is None or manifest.get("batch") != cfg.queue.batch:
        raise ConfigError(f"{cfg.out_dir}: the batch {cfg.queue.batch} is no longer the folder's (a new one began)")
    return BatchQueue(cfg.out_dir, manifest)


def worker_label(report_name: str) -> str:
    """How status lines and records name a replica's worker: by its report (a task's, a
    replica's, a join's) and host."""
    name = Path(report_name).stem
    return f"{'main' if name == 'report' else name}@{socket.gethostname()}"


def own_skips(cfg: RunConfig, skipped: dict[str, dict]) -> dict[str, dict]:
    """Of the items complete on disk, those this run reports as skipped: under the queue, only
    what the batch left out when it began (made by an earlier run); what other workers of the
    batch made since is theirs to report."""
    if not cfg.queue.shared:
        return skipped
    left_out = {e["id"] for e in open_batch(cfg).manifest["items"] if e.get("skipped")}
    return {k: v for k, v in skipped.items() if k in left_out}


def own_decided(cfg: RunConfig, decided: dict[str, dict], report_name: str) -> dict[str, dict]:
    """Of the items earlier launches of this command settled, those this replica's report lists:
    its own share's (--queue static), or under the queue those its own worker published (the
    record's fence names it); another worker's are that worker's to report, and every replica of
    a relaunch listing them all would count them twice."""
    if not cfg.queue.shared:
        return decided
    label = worker_label(report_name)
    return {k: v for k, v in decided.items() if (v.get("queue") or {}).get("label") == label}


class QueueWork:
    """The items this replica's writer claims from the queue, one at a time, on every rank."""

    def __init__(self, cfg: RunConfig, ctx: RankContext, todo: list[Item], observer: Observer, label: str) -> None:
        self.cfg, self.ctx, self.observer = cfg, ctx, observer
        self.items = {item.id: item for item in todo}
        self.queue = self.worker = self.keeper = None
        self.published: tuple[str, dict] | None = None  # the last item this worker published, and its fence
        if ctx.is_writer:
            self.queue = open_batch(cfg)
            self.worker = Worker.here(label, cfg.queue.launch)
            self.keeper = LeaseKeeper(self.queue, self.worker)
            self._earlier_self()

    def _earlier_self(self) -> None:
        """Leases of this worker's launch key that another process holds are an earlier attempt
        of the same job's (Slurm requeued it after preemption or its time limit: that attempt
        is over); recorded failed now rather than waited out."""
        mine = self.worker
        for lease in self.queue.leases_of(lambda d: d.get("launch") == mine.launch and d.get("pid") != mine.pid):
            recorded, final = self.queue.fail(lease, "an earlier attempt of its job was requeued", False, mine.id)
            if recorded and lease.item in self.items:
                record_failure(
                    self.cfg,
                    self.items[lease.item],
                    "an earlier attempt of its job was requeued",
                    self.queue.state(lease.item).leases,
                    final=final,
                )

    # -- the items ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Item]:
        while True:
            kind, item_id = self.ctx.from_writer(self._next() if self.ctx.is_writer else None)
            if kind == "end":
                return
            if kind == "item":
                yield self.items[item_id]

    def _next(self) -> tuple[str, str | None]:
        """("item", id) claimed, ("wait", None) when others hold what is left (told at least
        every BROADCAST_S), ("end", None) when every item is settled or the batch was replaced."""
        deadline = time.monotonic() + BROADCAST_S
        self.keeper.set(None, "idle")
        while True:
            if not self.queue.current():
                self.observer.message(
                    f"{self.worker.label}: the batch was replaced by a new run of the folder; stopping"
                )
                return "end", None
            got = self.queue.claim(self.worker, self._given_up)
            if isinstance(got, Lease):
                if got.item not in self.items:  # a run's items are the batch's: never so
                    raise ConfigError(f"{self.cfg.out_dir}: the queue holds item {got.item}, which this run lacks")
                self.keeper.set(got, "working")
                return "item", got.item
            if got == "end" or time.monotonic() > deadline:
                return (got if got == "end" else "wait"), None
            sleep_idle(self.queue.lease_s)

    def _given_up(self, item_id: str, record: dict, attempts: int) -> None:
        item = self.items.get(item_id)
        if item is not None:
            record_failure(self.cfg, item, record["error"], attempts, final=True)
            self.observer.message(f"{item_id} failed ({record['error']}); giving it up after {attempts} attempt(s)")

    # -- its files ----------------------------------------------------------------------
    def fence(self) -> dict:
        lease = self.keeper.lease
        return {"batch": self.queue.batch, "token": lease.token, "worker": self.worker.id, "label": self.worker.label}

    def begin(self, cfg: RunConfig, item: Item) -> None:
        return None  # the lease says the item is in flight

    def write(self, cfg: RunConfig, item: Item, *args, **kwargs) -> dict | None:
        """Write the item's files into the lease's staging folder, then publish them if the lease
        still holds; None when it was taken over (the files are discarded, a line says so). An
        item this worker published already and makes again (--target-psnr's recalibration) is
        written in place: once done, no other worker touches it."""
        lease = self.keeper.lease
        if lease is None and self.published is not None and self.published[0] == item.id:
            return write_item(cfg, item, *args, fence=self.published[1], **kwargs)
        fence = self.fence()
        record = write_item(replace(cfg, out_dir=self.queue.stage(lease)), item, *args, fence=fence, **kwargs)
        if self.queue.publish(lease, record):
            self.keeper.set(None, "idle", done=True)
            self.published = (item.id, fence)
            return record
        self.observer.message(self.queue.discard(lease, self.worker))
        self.keeper.set(None, "idle")
        return None

    def fail(self, cfg: RunConfig, item: Item, error: str, final: bool) -> dict | None:
        """Record the attempt failed (given up when `final` or out of retries); None when the
        lease was taken over already (the taker counted the attempt)."""
        lease = self.keeper.lease
        if lease is None:
            return None
        recorded, final = self.queue.fail(lease, error, final, self.worker.id)
        self.keeper.set(None, "idle", failed=recorded)
        if not recorded:
            return None
        attempts = self.queue.state(item.id).leases
        return record_failure(cfg, item, error, attempts, final=final)

    def close(self, state: str) -> None:
        if self.keeper is not None:
            self.keeper.stop(state)


class LeaseKeeper:
    """The writer's thread: renews the lease it holds every quarter of the lease, and rewrites
    its worker file (`ditango status`: which item, since when, how many made)."""

    def __init__(self, queue: BatchQueue, worker: Worker) -> None:
        self.queue, self.worker = queue, worker
        self.lease: Lease | None = None
        self.state, self.since, self.started = "idle", time.time(), now_text()
        self.done = self.failed = 0
        self.item_s: list[float] = []  # each published item's time, claim to publication
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.path = queue.worker_file(worker.id)
        make_folder(self.path.parent)
        self._write()
        self._thread = threading.Thread(target=self._run, name="ditango-lease", daemon=True)
        self._thread.start()

    def set(self, lease: Lease | None, state: str, done: bool = False, failed: bool = False) -> None:
        with self._lock:
            if done:
                self.done += 1
                self.item_s.append(time.time() - self.since)
            self.failed += int(failed)
            self.lease, self.state, self.since = lease, state, time.time()
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(renew_every(self.queue.lease_s)):
            with self._lock:
                lease = self.lease
            if lease is not None and not self.queue.renew(lease):
                with self._lock:
                    self.state = "lost"  # taken over: its files will be discarded at publication
            self._write()

    def _write(self) -> None:
        with self._lock:
            lease = self.lease
            data = {
                **self.worker.to_json(),
                "state": self.state,
                "item": None if lease is None else lease.item,
                "token": None if lease is None else lease.token,
                "since": self.since,
                "started_at": self.started,
                "updated": time.time(),
                "done": self.done,
                "failed": self.failed,
                "item_s": [round(s, 3) for s in self.item_s[-20:]],
            }
        try:
            replace_json(self.path, data)
        except OSError:  # a full disk: the lease file is what counts, this is only the status view
            pass

    def stop(self, state: str) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self.state, self.lease = state, None
        self._write()
