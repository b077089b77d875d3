"""Workers sharing one batch's queue as real processes (`ditango generate` on the built-in
model): a replica killed (SIGKILL) in the middle of an item, a writer stopped (SIGSTOP) past its
lease and continued after another worker took its item, and a second worker joining a running
batch (`--join`). In each, every item is written once, by the worker its sidecar names, whose
fencing token the report repeats."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.batch_open import read_batch
from runtime.batch_queue import BatchQueue
from runtime.queue_status import history
from tests.conftest import FAST_ARGV

pytestmark = pytest.mark.queue

CLI = [sys.executable, "-m", "ditango_cli.app", "generate"]
SLOW = ["--steps", "12", "--height", "32", "--width", "64", "--frames", "9", "--device", "cpu"]


def prompts(folder: Path, n: int) -> Path:
    path = folder / "batch.txt"
    colours = ["red", "green", "blue"] * 4
    path.write_text("".join(f"a {colours[k]} shape moving, take {k}\n" for k in range(n)))
    return path


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def workers(out: Path) -> list[dict]:
    found = []
    for path in out.glob(".ditango/queue/*/workers/*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being replaced
            continue
    return found


def wait_for(what, timeout: float = 120.0, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(poll)
    raise AssertionError("timed out waiting")


def every_item_once(out: Path, n: int) -> dict:
    """The report lists each of the n items once, done; each item's history has one "done", by
    the lease its sidecar names; the MP4 is the one the sidecar hashed. Returns the report."""
    report = json.loads((out / "report.json").read_text())
    ids = [item["id"] for item in report["items"]]
    assert len(ids) == len(set(ids)) == n and report["counts"]["done"] == n, report["counts"]
    queue = BatchQueue(out, read_batch(out))
    for item in report["items"]:
        sidecar = json.loads((out / f"{item['id']}.json").read_text())
        assert sidecar["queue"] == item["queue"]  # the fencing token the report repeats
        done = [h for h in history(queue, item["id"]) if h["kind"] == "done"]
        assert len(done) == 1 and done[0]["lease"] == sidecar["queue"]["token"]
        video = (out / f"{item['id']}.mp4").read_bytes()
        assert hashlib.sha256(video).hexdigest() == sidecar["video_sha256"]
    return report


def two_replicas_one_at_work(tmp_path: Path, out: Path, lease: float) -> tuple[subprocess.Popen, dict]:
    """4 items on 2 replicas of 1 rank under `lease`; once replica 1 is at work on an item: the
    run, and replica 1's worker file (its pid, its item)."""
    args = ["--prompts", str(prompts(tmp_path, 4)), *SLOW, "--gpus", "2", "--replicas", "2", "--lease", str(lease)]
    proc = start(*args, "--out", str(out))

    def replica_1_at_work() -> dict | None:
        return next((w for w in workers(out) if w["state"] == "working" and "replica-1" in w["label"]), None)

    return proc, wait_for(replica_1_at_work)


def test_a_replica_killed_in_an_item_loses_nothing(tmp_path):
    out = tmp_path / "out"
    proc, victim = two_replicas_one_at_work(tmp_path, out, lease=3)
    # Inside the item: "working" holds from the claim to the publish, and on an idle machine an
    # item of SLOW takes under a second (a 1 s wait here once let it finish first).
    time.sleep(0.2)
    os.kill(victim["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"{victim['item']} failed (replica 1: rank 1 failed: process killed by signal 9" in err
    assert "note: replica 1 was lost" in err and "the other workers finished the batch" in err
    report = every_item_once(out, 4)
    made = {item["id"]: item["queue"] for item in report["items"]}
    # its history: lease 1 (the killed replica's), 2 its failure as the launcher recorded it, lease 3
    assert made[victim["item"]]["token"] == 3 and "replica-0" in made[victim["item"]]["label"]


def test_a_writer_stopped_past_its_lease_publishes_nothing(tmp_path):
    out = tmp_path / "out"
    proc, victim = two_replicas_one_at_work(tmp_path, out, lease=2)
    os.kill(victim["pid"], signal.SIGSTOP)
    item = victim["item"]
    try:  # another worker takes the item over and publishes it
        wait_for(lambda: any(h.get("kind") == "done" for h in history(BatchQueue(out, read_batch(out)), item)))
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"{item}: lease 1 of replica-1" in err and "its late files are discarded" in err
    report = every_item_once(out, 4)
    sidecar = json.loads((out / f"{item}.json").read_text())
    assert sidecar["queue"]["token"] == 2 and "replica-0" in sidecar["queue"]["label"]
    assert list(out.glob(f".ditango/queue/*/discarded/{item}.1.json"))
    assert not list(out.glob(".ditango/queue/*/staging/*"))  # the late files went
    assert report["counts"]["failed"] == 0


def test_a_worker_joins_a_running_batch_and_both_make_items(tmp_path):
    out = tmp_path / "out"
    first = start("--prompts", str(prompts(tmp_path, 8)), *SLOW, "--steps", "24", "--out", str(out))
    wait_for(lambda: len(list(out.glob("*.mp4"))) >= 2, timeout=180)
    joined = start("--join", str(out), "--device", "cpu")
    manifest = (out / ".ditango" / "queue" / "batch.json").read_bytes()
    for change, needle in (
        (["--steps", "5"], "reads steps 5 here, 24 in the batch"),
        (["--model", "wan2.1-1.3b"], "model"),
    ):
        refused = subprocess.run([*CLI, "--join", str(out), *change, "--quiet"], capture_output=True, text=True)
        assert refused.returncode == 2 and needle in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    assert (out / ".ditango" / "queue" / "batch.json").read_bytes() == manifest  # nothing changed
    _, err = joined.communicate(timeout=300)
    assert joined.returncode == 0, err
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert len(workers(out)) == 2 and len(list(out.glob(".ditango/reports/join-*"))) == 1  # the refused: none
    report = every_item_once(out, 8)
    makers = {item["queue"]["label"].split("@")[0] for item in report["items"]}
    assert makers == {"main", "join-" + next(out.glob(".ditango/reports/join-*")).name.split("-")[1] + "-task-0"}


def test_a_static_batch_has_no_queue_to_join(tmp_path):
    out = tmp_path / "out"
    made = subprocess.run(
        [*CLI, "--prompt", "a dot", *FAST_ARGV, "--queue", "static", "--out", str(out)], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    refused = subprocess.run([*CLI, "--join", str(out)], capture_output=True, text=True)
    assert refused.returncode == 2 and "has no batch to join" in refused.stderr
