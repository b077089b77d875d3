"""One owner per output folder, namespaced bookkeeping, tolerant reads, partial files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from runtime.lock import FolderBusy, FolderLock
from runtime.outputs import state_dir

TINY = ["--device", "cpu", "--quiet", "--steps", "1", "--height", "16", "--width", "16", "--frames", "1"]


def _prompts(tmp_path, ids):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": f"a red ball moving {i}"}) + "\n" for i in ids))
    return f


def _generate(runner, *args):
    from ditango_cli.app import app

    return runner.invoke(app, ["generate", *args])


def _write_lock(out, **owner):
    state_dir(out).mkdir(parents=True, exist_ok=True)
    lock = state_dir(out) / "lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": "t", **owner}))
    return lock


# -- the lock ---------------------------------------------------------------------------


def test_a_held_folder_refuses_a_second_owner_until_released(tmp_path):
    first = FolderLock(tmp_path).acquire()
    with pytest.raises(FolderBusy, match=rf"in use by pid {os.getpid()} on {socket.gethostname()}"):
        FolderLock(tmp_path).acquire()
    first.release()
    assert not (state_dir(tmp_path) / "lock").exists()
    FolderLock(tmp_path).acquire().release()


def test_a_crashed_owner_does_not_hold_the_folder_forever(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid)  # same host, process gone
    notes = []
    FolderLock(tmp_path).acquire(say=notes.append).release()
    assert any("is gone" in n and str(dead.pid) in n for n in notes)


def test_a_stopped_owner_on_this_host_keeps_the_folder(tmp_path):
    """The bug: a live owner whose heartbeat lagged past the lease (Ctrl-Z, SIGSTOP, a
    suspended machine) lost OUT to a second run without knowing, and both wrote into it."""
    lock = _write_lock(tmp_path)  # this process: alive
    old = time.time() - 600
    os.utime(lock, (old, old))
    with pytest.raises(FolderBusy, match=rf"in use by pid {os.getpid()}"):
        FolderLock(tmp_path).acquire()


def test_a_reused_pid_is_not_the_owner(tmp_path):
    """A lock whose pid now belongs to another process (another start time) is stale."""
    _write_lock(tmp_path, pid_start=1)  # this pid, but a process that started at tick 1
    notes = []
    FolderLock(tmp_path).acquire(say=notes.append).release()
    assert any("is gone" in n for n in notes)


def test_a_lock_of_another_host_is_stale_only_after_its_lease(tmp_path, monkeypatch):
    lock = _write_lock(tmp_path, host="some-other-node", pid=1)
    with pytest.raises(FolderBusy, match="some-other-node"):
        FolderLock(tmp_path).acquire()  # fresh: its owner may be alive over there
    old = time.time() - 600
    os.utime(lock, (old, old))
    notes = []
    FolderLock(tmp_path).acquire(say=notes.append).release()
    assert any("has not refreshed it" in n for n in notes)


def test_a_damaged_lock_is_taken_over_once_it_cannot_be_one_being_written(tmp_path):
    lock = state_dir(tmp_path) / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"\xff\xfe not json")
    old = time.time() - 60
    os.utime(lock, (old, old))
    notes = []
    FolderLock(tmp_path).acquire(say=notes.append).release()
    assert any("damaged" in n for n in notes)


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    mine = FolderLock(tmp_path).acquire()
    lock = state_dir(tmp_path) / "lock"
    lock.write_text(json.dumps({"host": "x", "pid": 1, "token": "someone-else"}))  # taken over meanwhile
    mine.release()
    assert lock.exists()


def test_waiting_for_the_folder_takes_it_when_the_owner_ends(tmp_path):
    first = FolderLock(tmp_path).acquire()
    threading.Timer(1.0, first.release).start()
    notes = []
    start = time.monotonic()
    FolderLock(tmp_path).acquire(wait=True, say=notes.append, poll_s=0.1).release()
    assert time.monotonic() - start >= 0.9 and any(n.startswith("waiting for") for n in notes)


# -- through the CLI --------------------------------------------------------------------


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


@pytest.mark.e2e
def test_two_runs_into_one_folder_never_generate_an_item_twice(runner, tmp_path):
    prompts = _prompts(tmp_path, ["a", "b"])
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "ditango_cli.app",
        "generate",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        *[a for a in TINY if a != "--quiet"],
    ]
    # The first run freezes itself (SIGSTOP) after step 1 of item a, holding the folder,
    # until the test lets it go on: the second and third runs start while it owns OUT.
    frozen = {**os.environ, "DITANGO_FAULT_INJECT": "0:1:a", "DITANGO_FAULT_KIND": "stop"}
    first = subprocess.Popen(cmd, env=frozen, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _state(first.pid) != "T" and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(first.pid) == "T", first.communicate()
    second = _generate(runner, "--prompts", str(prompts), "--out", str(out), *TINY)
    assert second.exit_code == 2 and second.stderr.count("\n") == 1
    assert (
        second.stderr.startswith(f"error: {out} is in use by pid {first.pid} on ")
        and "--wait-for-lock" in second.stderr
    )
    third = subprocess.Popen([*cmd, "--wait-for-lock"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(third.stderr), daemon=True)
    reader.start()
    while not any(line.startswith("waiting for") for line in said) and third.poll() is None:
        time.sleep(0.05)
    assert third.poll() is None, said
    os.kill(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    made = {p.name: p.stat().st_mtime_ns for p in out.glob("*.mp4")}
    third.wait(timeout=300)
    reader.join()
    assert third.returncode == 0, said
    assert any("0 generated, 2 skipped, 0 failed" in line for line in said), said
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.mp4")} == made  # not written again
    assert sorted(made) == ["a.mp4", "b.mp4"] and not (state_dir(out) / "lock").exists()


def test_partial_files_of_a_killed_writer_are_removed_by_the_next_run(runner, tmp_path):
    out = tmp_path / "out"
    (out / ".ditango" / "reports").mkdir(parents=True)
    left = [
        out / ".a.partial-4242.mp4",
        out / ".a.partial-4242.json",
        out / ".ditango" / "reports" / ".task-0.partial-7.json",
    ]
    for path in left:
        path.write_bytes(b"half a file")
    kept = out / "notes.partial-1.txt"  # not a name this tool writes: left alone
    kept.write_text("mine")
    result = _generate(runner, "--prompt", "a red ball", "--out", str(out), *TINY)
    assert result.exit_code == 0, result.stderr
    assert not any(p.exists() for p in left) and kept.read_text() == "mine"
    assert not list(out.glob(".*.partial-*"))  # nor any of this run's own


def test_a_run_with_every_item_done_starts_no_rank(runner, tmp_path, monkeypatch):
    prompts = _prompts(tmp_path, ["a", "b"])
    out = tmp_path / "out"
    assert _generate(runner, "--prompts", str(prompts), "--out", str(out), *TINY).exit_code == 0
    import slurm.launchers.local

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started for a batch with nothing left to do")

    monkeypatch.setattr(slurm.launchers.local, "run_ranks", no_ranks)
    again = _generate(runner, "--prompts", str(prompts), "--out", str(out), *TINY, "--gpus-per-node", "2")
    assert again.exit_code == 0, again.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["counts"] == {"done": 0, "skipped": 2, "failed": 0}


def test_ids_named_like_bookkeeping_files_keep_their_outputs(runner, tmp_path):
    prompts = _prompts(tmp_path, ["jobs", "report.task-0", "lock"])
    out = tmp_path / "out"
    first = _generate(
        runner, "--prompts", str(prompts), "--out", str(out), *TINY, "--array", "2", "--executor", "local"
    )
    assert first.exit_code == 0, first.stderr
    sidecars = {i: json.loads((out / f"{i}.json").read_text()) for i in ("jobs", "report.task-0", "lock")}
    assert {i: r["status"] for i, r in sidecars.items()} == dict.fromkeys(sidecars, "done")
    again = _generate(
        runner, "--prompts", str(prompts), "--out", str(out), *TINY, "--array", "2", "--executor", "local"
    )
    assert again.exit_code == 0 and json.loads((out / "report.json").read_text())["counts"]["skipped"] == 3
    from ditango_cli.app import app

    status = runner.invoke(app, ["status", str(out)])  # the item "jobs" is not the job list
    assert status.exit_code == 0 and "no Slurm job is recorded" in status.stdout and "3 done" in status.stdout


@pytest.mark.parametrize("item_id", ["report", "clip.plan", "clip.latents", "clip.rel_mae"])
def test_ids_whose_files_would_collide_are_refused_with_the_reason(runner, tmp_path, item_id):
    result = _generate(runner, "--prompts", str(_prompts(tmp_path, [item_id])), "--out", str(tmp_path / "o"), *TINY)
    assert result.exit_code == 2 and "reserved: its files would collide with" in result.stderr
    assert not (tmp_path / "o").exists()


def test_report_refuses_a_folder_that_is_not_an_output_of_this_tool(runner, tmp_path):
    from ditango_cli.app import app

    theirs = tmp_path / "report.json"
    theirs.write_text('{"my": "own report"}')
    for command in (["report"], ["status"], ["cancel"]):
        result = runner.invoke(app, [*command, str(tmp_path)])
        assert result.exit_code == 2 and "not an output folder of ditango" in result.stderr, command
    assert theirs.read_text() == '{"my": "own report"}'


def test_report_twice_keeps_the_run_and_prints_a_calibration(runner, tmp_path):
    """A second `report` reads its own earlier aggregate for the run's keys (model, layout,
    options, calibration), which no task report holds for a local run."""
    from ditango_cli.app import app

    out = tmp_path / "out"
    assert _generate(runner, "--prompt", "a red ball", "--out", str(out), *TINY).exit_code == 0
    report = json.loads((out / "report.json").read_text())
    calibration = {
        "target_psnr": 40.0,
        "item": report["items"][0]["id"],
        "planner": "budget",
        "cache_ratio": 0.81,
        "calibrated_psnr": 40.7,
        "trials": [{"cache_ratio": 0.81, "psnr": 40.7}] * 5,
        "seconds": 1.0,
    }
    (out / "report.json").write_text(json.dumps({**report, "calibration": calibration}))
    for _ in range(2):
        result = runner.invoke(app, ["report", str(out)])
        assert result.exit_code == 0, result.stderr
        assert "--target-psnr 40: cache ratio 0.81 (budget planner), 40.70 dB on" in " ".join(result.stdout.split())
        merged = json.loads((out / "report.json").read_text())
        assert merged["layout"] == report["layout"] and merged["options"] == report["options"]
        assert merged["calibration"] == calibration


def test_a_report_json_this_tool_did_not_write_is_never_replaced(runner, tmp_path):
    from ditango_cli.app import app

    out = tmp_path / "out"
    assert _generate(runner, "--prompt", "a red ball", "--out", str(out), *TINY).exit_code == 0
    (out / "report.json").write_text("a file of my own")
    for args in (
        ["report", str(out)],
        ["generate", "--prompt", "a blue ball", "--out", str(out), *TINY],
        ["check", "--prompt", "a blue ball", "--out", str(out)],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "is not a report of ditango" in result.stderr, args
    assert (out / "report.json").read_text() == "a file of my own"


@pytest.mark.parametrize(
    "damage",
    [
        b"\xff\xfe\x00 not utf-8",
        b'{"schema": 1, "id": "a", "status": "done"',
        b'{"schema": 1, "id": "a", "status": "done", "timing": "fast"}',
        b'{"schema": 1, "id": "a", "status": "done", "timing": {"total_s": "slow"}, "error": 7}',
        b'["a list"]',
    ],
    ids=["not-utf8", "truncated", "wrong-shape", "wrong-field-types", "not-a-record"],
)
def test_a_damaged_sidecar_is_redone_with_a_note_and_reports_still_work(runner, tmp_path, damage):
    from ditango_cli.app import app

    out = tmp_path / "out"
    prompts = _prompts(tmp_path, ["a", "b"])
    assert _generate(runner, "--prompts", str(prompts), "--out", str(out), *TINY).exit_code == 0
    (out / "a.json").write_bytes(damage)
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0  # a damaged sidecar is not a crash
    loud = [a for a in TINY if a != "--quiet"]
    again = runner.invoke(app, ["generate", "--prompts", str(prompts), "--out", str(out), *loud])
    assert again.exit_code == 0, again.stderr
    assert f"{out / 'a.json'}" in again.stderr and "a is generated again" in again.stderr
    assert json.loads((out / "report.json").read_text())["counts"] == {"done": 1, "skipped": 1, "failed": 0}


@pytest.mark.slurm
def test_a_slurm_batch_with_every_item_done_submits_nothing(runner, tmp_path):
    prompts = _prompts(tmp_path, ["a", "b"])
    out = tmp_path / "out"
    assert _generate(runner, "--prompts", str(prompts), "--out", str(out), *TINY, "--executor", "local").exit_code == 0
    again = _generate(
        runner,
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        *TINY,
        "--executor",
        "slurm",
        "--nodes",
        "2",
        "--partition",
        "debug",
        "--array",
        "2",
    )
    assert again.exit_code == 0, again.stderr
    assert not (state_dir(out) / "jobs.json").exists() and not (out / "slurm").exists()


def test_check_says_what_generate_would_about_an_owned_folder(runner, tmp_path):
    from ditango_cli.app import app

    out = tmp_path / "out"
    with FolderLock(out).acquire():
        result = runner.invoke(app, ["check", "--prompt", "a red ball", "--out", str(out), *TINY[:2]])
    assert result.exit_code == 2 and f"{out} is in use by pid {os.getpid()}" in result.stderr
    assert runner.invoke(app, ["check", "--prompt", "a red ball", "--out", str(out), *TINY[:2]]).exit_code == 0


@pytest.mark.parametrize(
    "changed", [{"guidance_2": 7.5}, {"true_cfg": 4.0}, {"image": "/elsewhere/b.png"}], ids=lambda c: next(iter(c))
)
def test_resume_refuses_an_output_made_with_another_image_or_guidance(tmp_path, changed):
    """The bug: resume compared only the Wan2.1 fields, so an item rerun with another image,
    a second expert's guidance or a real-CFG scale was skipped as done with the old video."""
    from dataclasses import replace

    from basics.errors import ConfigError
    from runtime.config import Item, RunConfig
    from runtime.outputs import output_paths
    from runtime.report import item_record
    from runtime.resume import plan_resume
    from runtime.video import write_json

    item = Item("x", "a red ball", "", 0, 32, 32, 5, 2, 5.0, image="/here/a.png")
    cfg = RunConfig("tiny-wan", None, (item,), tmp_path)
    paths = output_paths(tmp_path, "x")
    paths["video"].write_bytes(b"mp4")
    write_json(
        paths["sidecar"], item_record(item, model="tiny-wan", status="done", video="x.mp4", latents=None, timing=None)
    )
    assert set(plan_resume(cfg)) == {"x"}  # the same item: skipped
    other = replace(cfg, items=(replace(item, **changed),))
    key = {"true_cfg": "true_cfg_scale"}.get(next(iter(changed)), next(iter(changed)))
    with pytest.raises(ConfigError, match=f"was made with {key} "):
        plan_resume(other)
