"""Progress that a log file shows (Slurm, nohup, `| tee`): the ETA arithmetic (`Pace`), the
plain timestamped lines, the writer's heartbeat file that `ditango status` reads, and the
report's `timing` section. Guards the bug: under Slurm or `2> log` no step progress at all."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from ditango_cli.app import app
from runtime.context import SilentObserver
from runtime.outputs import state_dir
from runtime.pace import Pace, duration, progress_text
from runtime.progress import LogObserver, ProgressFile, heartbeat_line, progress_path, read_progress
from runtime.report import TIMING_SUMS
from slurm.aggregate import aggregate

STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")
TOL_S = 1e-9


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def item(item_id: str, steps: int):
    return SimpleNamespace(id=item_id, steps=steps)  # what the observers read of an Item


def due_steps(pace: Pace, clock: FakeClock, steps: int, step_s: float, count: int | None = None) -> list[int]:
    """The steps after which a line is due, of the first `count` (default all) of `steps`."""
    due = []
    for i in range(1, (count or steps) + 1):
        clock.now += step_s
        if pace.step_done(i, steps):
            due.append(i)
    return due


def test_fast_steps_give_a_line_every_tenth_of_the_steps():
    clock = FakeClock()
    pace = Pace(clock=clock)
    pace.run_started(5)
    pace.item_started("a", 20)
    assert due_steps(pace, clock, 20, 0.01) == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    pace.item_started("b", 5)  # fewer steps than lines: one line per step
    assert due_steps(pace, clock, 5, 0.01) == [1, 2, 3, 4, 5]


def test_slow_steps_give_a_line_at_least_every_30_s():
    clock = FakeClock()
    pace = Pace(clock=clock)
    pace.run_started(1)
    pace.item_started("a", 1000)  # 10% would be 100 steps: far more than 30 s at 20 s a step
    due = due_steps(pace, clock, 1000, 20.0, count=10)
    assert due == [2, 4, 6, 8, 10]  # every 40 s of steps: the first step after 30 s went by


def test_eta_is_remaining_steps_at_the_mean_pace_plus_the_overhead_of_items_done():
    clock = FakeClock()
    pace = Pace(clock=clock)
    pace.run_started(3)
    pace.item_started("a", 10)
    assert pace.s_per_step is None and pace.eta_batch_s is None
    times = [3.0 + 2.0 * (i - 1) for i in range(1, 11)]  # step 1 holds 1 s of text encode and warm-up
    for i, t in enumerate(times[:5], 1):
        clock.now = t
        pace.step_done(i, 10)
    assert pace.s_per_step == pytest.approx(2.0, abs=TOL_S)  # the first step left out
    assert pace.eta_item_s == pytest.approx(5 * 2.0, abs=TOL_S)  # no item done: no overhead known
    assert pace.eta_batch_s == pytest.approx(10.0 + 2 * 10 * 2.0, abs=TOL_S)
    for i, t in enumerate(times[5:], 6):
        clock.now = t
        pace.step_done(i, 10)
    pace.set_phase("decode")
    clock.now = 25.0
    assert pace.item_finished() == pytest.approx(25.0, abs=TOL_S)
    assert pace.overhead_s == pytest.approx(25.0 - 10 * 2.0, abs=TOL_S)  # decode, write, encode, warm-up

    pace.item_started("b", 10)
    clock.now = 27.0
    pace.step_done(1, 10)
    clock.now = 29.0
    pace.step_done(2, 10)
    assert pace.eta_item_s == pytest.approx(8 * 2.0 + 5.0, abs=TOL_S)
    assert pace.eta_batch_s == pytest.approx(21.0 + 1 * (10 * 2.0 + 5.0), abs=TOL_S)
    for i in range(3, 11):
        clock.now += 2.0
        pace.step_done(i, 10)
    pace.set_phase("decode")
    clock.now += 2.0  # 2 s into the decode: 3 s of the usual 5 s overhead left
    assert pace.eta_item_s == pytest.approx(3.0, abs=TOL_S)
    assert pace.eta_batch_s == pytest.approx(3.0 + 25.0, abs=TOL_S)
    text = progress_text(pace.snapshot())
    assert text == "item 2/3 b: decode, step 10/10, 2.00 s/step, ETA item 3.0 s, batch 28 s", text


def test_a_rerun_of_an_items_steps_starts_its_pace_again():
    """--target-psnr regenerates an item (no item_started): its steps count from 1 again."""
    clock = FakeClock()
    pace = Pace(clock=clock)
    pace.run_started(1)
    pace.item_started("a", 4)
    due_steps(pace, clock, 4, 1.0)
    clock.now += 100.0  # the check between the two runs
    assert due_steps(pace, clock, 4, 3.0) == [1, 2, 3, 4]
    assert pace.s_per_step == pytest.approx(3.0, abs=TOL_S)


def test_durations_read_as_a_person_would():
    assert [duration(s) for s in (0.42, 23, 161, 3720, -1)] == ["0.4 s", "23 s", "2m41s", "1h02m", "0.0 s"]


def test_log_observer_writes_timestamped_lines_to_a_log_stream():
    clock = FakeClock()
    stream = io.StringIO()  # not a terminal, as a Slurm log or `2> file`
    with LogObserver(stream, Pace(clock=clock)) as observer:
        observer.run_started(2)
        observer.item_started(item("a-red-circle", 20))
        for i in range(1, 21):
            clock.now += 1.5
            observer.step_done(i, 20)
        observer.phase("decode")
        clock.now += 2.0
        observer.item_finished({"status": "done", "video": "a-red-circle.mp4"})
        observer.message("a note")
        observer.item_started(item("b", 20))
        clock.now += 5.0
        observer.item_finished({"status": "failed", "error": "NonFiniteLatents: boom"})
    lines = stream.getvalue().splitlines()
    assert lines.pop().endswith(" item 2/2 b: failed after 5.0 s: NonFiniteLatents: boom"), lines
    assert lines.pop().endswith(" item 2/2 b: started (20 steps)")
    assert lines.pop() == "a note"  # the supervisor's notes read as on a terminal
    assert all(STAMPED.match(line) for line in lines), lines
    steps = [line for line in lines if "step " in line]
    assert len(steps) == 10
    assert steps[3].endswith("item 1/2 a-red-circle: step 8/20, 1.50 s/step, ETA item 18 s, batch 48 s"), steps[3]
    assert lines[0].endswith("item 1/2 a-red-circle: started (20 steps)")  # no line before: the model loads
    assert lines[-1].endswith("item 1/2 a-red-circle: done in 32.0 s -> a-red-circle.mp4, 1 left, ETA batch 32 s")


def test_rich_bar_shows_the_same_pace_and_etas_on_a_terminal():
    from ditango_cli.progress import RichObserver

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200)
    with RichObserver(console) as observer:
        observer.run_started(1)
        observer.item_started(item("a", 4))
        for i in range(1, 4):
            observer.step_done(i, 4)
        observer.progress.refresh()
    assert "s/step" in screen.getvalue() and "ETA item" in screen.getvalue(), screen.getvalue()


def test_heartbeat_file_holds_the_step_and_a_failed_write_never_fails_the_run(tmp_path):
    clock = FakeClock()
    path = progress_path(tmp_path, ".ditango/reports/task-1.json")
    beat = ProgressFile(SilentObserver(), path, Pace(clock=clock), every_s=2.0)
    beat.run_started(3)
    beat.item_started(item("x", 20))
    for i in range(1, 9):
        clock.now += 1.0
        beat.step_done(i, 20)
    data = json.loads(path.read_text())
    assert (data["state"], data["step"], data["steps"], data["item"]) == ("running", 8, 20, "x")
    assert [p.name for p in path.parent.iterdir()] == ["task-1.json"]  # no temp file left
    clock.now += 0.5
    beat.step_done(9, 20)  # within 2 s of the last write: not rewritten
    assert json.loads(path.read_text())["step"] == 8
    beat.finish()
    assert json.loads(path.read_text())["state"] == "finished"

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # its "folder" cannot be made: every write fails with OSError
    failing = ProgressFile(SilentObserver(), blocked / "progress" / "report.json", Pace(clock=clock))
    failing.run_started(1)
    failing.item_started(item("y", 2))
    failing.step_done(1, 2)
    failing.finish()
    assert blocked.read_text() == ""


def test_status_of_a_local_run_shows_the_running_items_step_eta_and_age(runner, tmp_path):
    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    clock = FakeClock()
    beat = ProgressFile(SilentObserver(), progress_path(out, "report.json"), Pace(clock=clock))
    beat.run_started(5)
    beat.item_started(item("a-red-circle", 20))
    for i in range(1, 9):
        clock.now += 2.0
        beat.step_done(i, 20)
    path = progress_path(out, "report.json")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "updated": time.time() - 42}))
    result = runner.invoke(app, ["status", str(out)])
    assert result.exit_code == 0, result.output
    assert "no Slurm job is recorded" in result.stdout and "0 done" in result.stdout
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("progress:")]
    assert "item 1/5 a-red-circle: step 8/20, 2.00 s/step, ETA item 24 s, batch 3m04s" in line, line
    assert re.search(r"updated 4[2-9] s ago", line), line


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """`ditango generate` of the built-in model, 20 steps, its stderr a file (not a terminal)."""
    root = tmp_path_factory.mktemp("logged")
    out, log = root / "out", root / "stderr.log"
    cli = [
        sys.executable,
        "-c",
        "from ditango_cli.app import main; main()",
        "generate",
        "--steps",
        "20",
        "--prompt",
        "a red circle",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    with log.open("w") as err:
        done = subprocess.run(cli, stdout=subprocess.PIPE, stderr=err, text=True, timeout=120)
    assert done.returncode == 0, log.read_text()
    return out, log.read_text()


def test_a_generate_whose_stderr_is_a_file_logs_its_steps(logged_run):
    _, text = logged_run
    lines = text.splitlines()
    steps = [ln for ln in lines if STAMPED.match(ln) and re.search(r"step \d+/20, .* ETA item .*, batch ", ln)]
    assert len(steps) >= 5, text
    assert any("step 20/20, " in ln for ln in steps), text  # the last step always has its line
    assert sum(bool(re.search(r"item 1/1 \S+: (started|done in)", ln)) for ln in lines) == 2, text


def test_report_says_where_the_wall_time_went(logged_run):
    out, _ = logged_run
    report = json.loads((out / "report.json").read_text())
    timing = report["timing"]
    assert set(timing) == set(TIMING_SUMS)
    assert all(timing[k] >= 0 for k in TIMING_SUMS), timing
    assert timing["model_load_s"] > 0 and timing["bring_up_s"] > 0 and timing["items"] == 1
    (record,) = report["items"]
    assert timing["decode_s"] == pytest.approx(record["timing"]["decode_s"], abs=1e-5)
    assert timing["write_s"] == pytest.approx(record["timing"]["write_s"], abs=1e-5)
    assert timing["decode_s"] + timing["write_s"] <= timing["items_s"] + 1e-5
    parts = timing["bring_up_s"] + timing["model_load_s"] + timing["calibration_s"] + timing["items_s"]
    assert parts <= report["wall_s"] + timing["bring_up_s"] + 1e-3  # wall_s starts after the bring-up began


def test_status_after_a_local_run_shows_its_items_and_the_finished_heartbeat(logged_run, runner):
    out, _ = logged_run
    result = runner.invoke(app, ["status", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 done" in result.stdout and "progress: finished: 1 done, 0 failed (updated" in result.stdout
    assert [name for name, _ in read_progress(out)] == ["report"]


def test_aggregate_sums_timing_and_reads_reports_without_it(logged_run, tmp_path):
    """Timing is summed over the reports the merged items come from: one written before
    `timing` existed is read without it, and one whose items a later run wrote again (an
    earlier run's array task) is left out, so its seconds are not counted twice."""
    src, _ = logged_run
    report = json.loads((src / "report.json").read_text())
    other = {**report, "items": [{**i, "id": f"{i['id']}-b"} for i in report["items"]]}  # another task's items
    old = {k: v for k, v in other.items() if k != "timing"}  # written before `timing` existed
    earlier = {**report, "started_at": "2000-01-01T00:00:00+00:00"}  # a task of an earlier run of the folder
    for folder, reports in (
        ("mixed", {"task-0": report, "task-1": old}),
        ("old", {"task-0": old}),
        ("stale", {"task-9": earlier, "task-0": report, "task-1": other}),
    ):
        out = tmp_path / folder
        (state_dir(out) / "reports").mkdir(parents=True)
        for when, (name, body) in enumerate(reports.items()):  # written in this order
            path = state_dir(out) / "reports" / f"{name}.json"
            path.write_text(json.dumps(body))
            os.utime(path, (1_000_000 + when, 1_000_000 + when))
        merged = aggregate(out, write=False)
        if folder == "old":
            assert "timing" not in merged
            continue
        tasks = [".ditango/reports/task-0.json"] + ([".ditango/reports/task-1.json"] if folder == "stale" else [])
        assert sorted(merged["timing"]["per_report"]) == tasks
        want = {k: round(report["timing"][k] * len(tasks), 6) for k in TIMING_SUMS}
        assert {k: merged["timing"][k] for k in TIMING_SUMS} == pytest.approx(want, abs=1e-5)


def test_heartbeat_line_of_a_stale_or_torn_file(tmp_path):
    progress = state_dir(tmp_path) / "progress"
    progress.mkdir(parents=True)
    (progress / "torn.json").write_text('{"state": "runn')
    (progress / ".report.123.tmp").write_text("{}")
    assert read_progress(tmp_path) == []
    line = heartbeat_line({"state": "running", "updated": 1000.0, "item_index": 0}, now=1000.0 + 3 * 3600)
    assert line.startswith("running: starting; 0 done, 0 failed (updated 3h00m ago"), line
    shutil.rmtree(progress)
    assert read_progress(tmp_path) == []


def test_a_run_that_fails_leaves_a_stopped_heartbeat(runner, tmp_path, monkeypatch):
    """A run that raised must not look alive to `ditango status`: its heartbeat says stopped."""
    from .conftest import FAST_ARGV

    monkeypatch.setenv("DITANGO_FAULT_INJECT", "0:1")
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["generate", "--prompt", "a red circle", "--out", str(out), "--retries", "0", *FAST_ARGV]
    )
    assert result.exit_code != 0
    ((_, data),) = read_progress(out)
    assert data["state"] == "stopped"
    assert heartbeat_line(data).startswith("stopped: ")
