"""The batch queue's rules on files alone (runtime/batch_queue.py, runtime/batch_open.py), no
model and no process: longest first, one holder per item under racing claims, takeover of a
lease that was not renewed or whose process is gone, the fence (a late holder never publishes),
retries counted over workers, a publication finished by whoever finds it half done, and the
batch begun, continued, refused and joined."""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from basics.errors import ConfigError
from runtime.batch_open import begin_batch, check_join, read_batch
from runtime.batch_queue import BatchQueue, Lease, Worker, manifest_path
from runtime.config import Item, QueueSpec, RunConfig
from runtime.outputs import read_record
from runtime.queue_status import history, queue_lines, queue_view

LEASE = 5.0


def config(out: Path, frames=(17, 17, 17, 17), retries: int = 1, steps: int = 2) -> RunConfig:
    items = tuple(
        Item(f"i{k}", f"a red ball {k}", "", 0, 64, 64, f, steps, 2.5, index=k, vae_stride=4)
        for k, f in enumerate(frames)
    )
    return RunConfig("tiny-wan", None, items, out, retries=retries, queue=QueueSpec("shared", LEASE))


def begun(tmp_path: Path, **kwargs) -> tuple[RunConfig, BatchQueue]:
    cfg = begin_batch(config(tmp_path, **kwargs), set(), "command-1", {"out": str(tmp_path)})
    return cfg, BatchQueue(tmp_path, read_batch(tmp_path))


def worker(name: str) -> Worker:
    return replace(Worker.here(name, f"launch-{name}/t0/r0"), id=name)


def age(lease: Lease, seconds: float) -> None:
    """As if its holder had not renewed it for `seconds`."""
    stamp = lease.path.stat().st_mtime - seconds
    os.utime(lease.path, (stamp, stamp))


def test_items_are_claimed_longest_first(tmp_path):
    """The cost model prices 33 frames above 9: the long items go first, ties in file order."""
    _, queue = begun(tmp_path, frames=(9, 33, 9, 65, 33))
    w = worker("a")
    order = []
    while isinstance(lease := queue.claim(w), Lease):
        order.append(lease.item)
    assert order == ["i3", "i1", "i4", "i0", "i2"]
    assert queue.claim(w) == "wait"  # every item held, none settled


def test_racing_workers_never_hold_the_same_item(tmp_path):
    """Eight threads claim at once, over and over: every item is held by exactly one of them."""
    _, queue = begun(tmp_path, frames=(17,) * 12)
    got: dict[str, list[str]] = {}
    start = threading.Barrier(8)

    def claim_all(name: str) -> None:
        w = worker(name)
        start.wait()
        while isinstance(lease := queue.claim(w), Lease):
            got.setdefault(lease.item, []).append(name)

    threads = [threading.Thread(target=claim_all, args=(f"w{k}",)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(f"i{k}" for k in range(12))
    assert all(len(holders) == 1 for holders in got.values()), got
    assert all([h.get("kind") for h in history(queue, i)] == ["lease"] for i in got)


def test_a_lease_not_renewed_is_taken_over_and_its_holder_cannot_publish(tmp_path):
    cfg, queue = begun(tmp_path, frames=(17,))
    late, taker = worker("late"), worker("taker")
    first = queue.claim(late)
    assert queue.claim(taker) == "wait" and queue.renew(first)
    age(first, LEASE + 1)
    second = queue.claim(taker)
    assert (second.item, second.token) == ("i0", 2)
    took = history(queue, "i0")[1]["took_over"]
    assert took["lease"] == 1 and "did not renew it" in took["why"]
    assert not queue.holds(first) and not queue.renew(first)  # its keeper stops renewing
    queue.stage(first).mkdir(parents=True)
    (queue.stage(first) / "i0.mp4").write_bytes(b"late")
    assert not queue.publish(first, {"queue": {"worker": "late"}})  # fenced off
    line = queue.discard(first, late)
    assert "lease 1 of late was taken over" in line and not queue.stage(first).exists()
    assert not (tmp_path / "i0.mp4").exists()
    stage = queue.stage(second)
    stage.mkdir(parents=True)
    (stage / "i0.mp4").write_bytes(b"new")
    (stage / "i0.json").write_text("{}")
    assert queue.publish(second, {"queue": {"worker": "taker"}})
    assert (tmp_path / "i0.mp4").read_bytes() == b"new" and not stage.exists()
    assert queue.claim(late) == "end"
    assert [h["kind"] for h in history(queue, "i0")] == ["lease", "lease", "done"]


def test_a_holder_that_publishes_first_wins_over_a_late_takeover(tmp_path):
    """The other order of the race: the publication is file 2, so the taker finds the item done."""
    _, queue = begun(tmp_path, frames=(17,))
    first = queue.claim(worker("slow"))
    age(first, LEASE + 1)
    assert queue.publish(first, {})
    assert queue.claim(worker("taker")) == "end"


def test_a_lease_whose_process_is_gone_is_taken_over_at_once(tmp_path):
    _, queue = begun(tmp_path, frames=(17,))
    proc = subprocess.Popen(["sleep", "0"])  # a pid that has exited
    proc.wait()
    gone = replace(worker("gone"), pid=proc.pid, pid_start=None)
    queue.claim(gone)
    lease = queue.claim(worker("taker"))
    assert isinstance(lease, Lease) and lease.token == 2
    assert f"pid {proc.pid}" in history(queue, "i0")[1]["took_over"]["why"]


def test_retries_count_over_workers_then_the_item_is_given_up(tmp_path):
    cfg, queue = begun(tmp_path, frames=(17,), retries=1)
    a, b, c = worker("a"), worker("b"), worker("c")
    assert queue.fail(queue.claim(a), "boom", False, a.id) == (True, False)  # attempt 1 of 2
    second = queue.claim(b)
    assert second.token == 3
    age(second, LEASE + 1)  # attempt 2 lost: no attempt left
    given = []
    assert queue.claim(c, lambda item, record, n: given.append((item, record["final"], n))) == "end"
    assert given == [("i0", True, 2)]
    assert history(queue, "i0")[-1]["error"].startswith("lease 3 lost")
    assert queue.left() == []


def test_a_late_failure_is_not_recorded_over_a_takeover(tmp_path):
    _, queue = begun(tmp_path, frames=(17,))
    first = queue.claim(worker("a"))
    age(first, LEASE + 1)
    queue.claim(worker("b"))
    assert queue.fail(first, "late", False, "a") == (False, False)


def test_a_publication_cut_short_is_finished_by_the_next_reader(tmp_path):
    """A writer killed between its "done" and its renames: the files wait staged, and whoever
    finds them moves them, the sidecar last."""
    _, queue = begun(tmp_path, frames=(17,))
    lease = queue.claim(worker("a"))
    stage = queue.stage(lease)
    stage.mkdir(parents=True)
    for name in ("i0.mp4", "i0.json", "i0.poster.png"):
        (stage / name).write_text(name)
    os.replace(stage / "i0.mp4", tmp_path / "i0.mp4")  # one file moved, then the writer died
    assert queue._next("i0", lease.token, {"kind": "done", "lease": lease.token}) is not None
    queue.finish_publishing(lease)
    assert sorted(p.name for p in tmp_path.glob("i0.*")) == ["i0.json", "i0.mp4", "i0.poster.png"]
    assert not stage.exists()


def test_the_same_command_goes_on_with_its_batch_and_another_is_refused_while_workers_live(tmp_path):
    cfg, queue = begun(tmp_path)
    again = begin_batch(config(tmp_path), set(), "command-1", {})
    assert again.queue.batch == cfg.queue.batch
    queue.claim(replace(worker("busy"), pid=os.getppid(), pid_start=None))  # a live process, not this one
    with pytest.raises(ConfigError, match="worker.s. of an earlier batch at work .*--join"):
        begin_batch(config(tmp_path), set(), "command-2", {})
    assert read_batch(tmp_path)["batch"] == cfg.queue.batch  # nothing changed
    for lease in queue.leases_of(lambda data: True):
        age(lease, LEASE + 1)
    fresh = begin_batch(config(tmp_path), {"i1"}, "command-2", {})
    assert fresh.queue.batch != cfg.queue.batch
    assert not queue.root.exists()  # the old batch's history went with it
    assert [e["id"] for e in read_batch(tmp_path)["items"] if e["skipped"]] == ["i1"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda c: replace(c, model="wan2.1-1.3b"), "made with model"),
        (lambda c: replace(c, items=tuple(replace(i, steps=3) for i in c.items)), "item i0 reads steps 3 here, 2 in"),
        (lambda c: replace(c, items=c.items[:-1]), "lacks item i3"),
    ],
)
def test_a_join_that_would_make_other_videos_is_refused(tmp_path, change, needle):
    cfg, _ = begun(tmp_path)
    before = manifest_path(tmp_path).read_bytes()
    with pytest.raises(ConfigError, match=needle):
        check_join(change(config(tmp_path)), read_batch(tmp_path))
    assert manifest_path(tmp_path).read_bytes() == before
    joined = check_join(config(tmp_path), read_batch(tmp_path))
    assert joined.queue.batch == cfg.queue.batch and joined.queue.shared


def test_a_folder_without_a_batch_cannot_be_joined(tmp_path):
    with pytest.raises(ConfigError, match="has no batch to join"):
        read_batch(tmp_path)


def test_status_names_each_worker_its_item_and_what_is_left(tmp_path):
    _, queue = begun(tmp_path)
    from runtime.pull import LeaseKeeper

    keeper = LeaseKeeper(queue, worker("busy"))
    keeper.set(queue.claim(keeper.worker), "working")
    view = queue_view(tmp_path)
    keeper.stop("finished")
    assert view["left"] == 4 and view["counts"]["leased"] == 1 and view["eta_s"] is None
    (busy,) = view["workers"]
    assert busy["item"] == "i0" and busy["state"] == "working" and busy["lease_age_s"] is not None
    assert "worker busy" in queue_lines(view)[1] and "item i0" in queue_lines(view)[1]


def test_a_given_up_item_has_a_failed_sidecar(tmp_path):
    """The taker that gives an item up writes its failed sidecar (runtime/pull.py)."""
    from runtime.pull import QueueWork

    cfg, queue = begun(tmp_path, frames=(17,), retries=0)
    age(queue.claim(worker("a")), LEASE + 1)
    work = QueueWork.__new__(QueueWork)
    work.cfg, work.items, work.observer = cfg, {i.id: i for i in cfg.items}, type("O", (), {"message": print})()
    assert queue.claim(worker("b"), work._given_up) == "end"
    record = read_record(tmp_path / "i0.json")
    assert record["status"] == "failed" and record["final"] and "lease 1 lost" in record["error"]


def test_a_relaunched_replica_reports_only_what_its_own_worker_made(tmp_path):
    """After a launch failed and is relaunched, every replica is told the items settled so far;
    under the queue each replica's report lists only those its own worker published (the
    record's fence), so the replicas' reports never list an item twice. --queue static keeps
    its share's."""
    import socket

    from runtime.pull import own_decided

    cfg, _ = begun(tmp_path)
    host = socket.gethostname()
    decided = {
        "i0": {"id": "i0", "status": "done", "queue": {"label": f"replica-0@{host}"}},
        "i1": {"id": "i1", "status": "done", "queue": {"label": f"replica-1@{host}"}},
        "i2": {"id": "i2", "status": "failed", "final": True},  # given up by the launcher: no fence
    }
    mine = [sorted(own_decided(cfg, decided, f".ditango/reports/replica-{r}.json")) for r in (0, 1)]
    assert mine == [["i0"], ["i1"]]
    static = replace(cfg, queue=replace(cfg.queue, mode="static"))
    assert own_decided(static, decided, ".ditango/reports/replica-0.json") == decided
