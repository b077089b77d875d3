"""What a hostile or careless user gives the other commands (`report`, `status`, `simulate`,
the Slurm options) and the files they read back: every case is one `error:` line and exit 2,
or a damaged file set aside, never a traceback. Each case once gave a traceback, hung, or ran
with a bad value."""

from __future__ import annotations

import json
import socket
import time

import pytest

from ditango_cli.app import app
from runtime.outputs import state_dir
from runtime.record_shape import HEARTBEAT, well_formed

from .conftest import FAST_ARGV

MARKUP = "[/b] x [red]"  # rich would read these as tags (and fail on the closing one)


def one_error(result, needle: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr[-2000:]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-item run in a folder whose name is markup to rich, with its prompt too."""
    from typer.testing import CliRunner

    out = tmp_path_factory.mktemp("runs") / f"out {MARKUP}"
    result = CliRunner().invoke(app, ["generate", "--prompt", f"a cat {MARKUP}", "--out", str(out), *FAST_ARGV])
    assert result.exit_code == 0, result.stderr[-2000:]
    return out


def test_text_that_looks_like_markup_is_printed_as_it_is(runner, tmp_path, finished):
    check = runner.invoke(app, ["check", "--prompt", f"a {MARKUP}", "--out", str(tmp_path / MARKUP), "--device", "cpu"])
    assert check.exit_code == 0 and MARKUP in check.stdout, check.stderr[-2000:]
    status = runner.invoke(app, ["status", str(finished)])
    assert status.exit_code == 0 and f"report: {finished}/report.json" in status.stdout
    report = runner.invoke(app, ["report", str(finished)])
    assert report.exit_code == 0 and "1 done, 0 skipped, 0 failed" in report.stdout, report.stderr[-2000:]


def _copy(finished, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    return out


@pytest.mark.parametrize(
    "damage",
    [
        {"quality": "bad"},
        {"quality": {"psnr": "x"}},
        {"step_cache": {"x": 1}},
        {"step_cache": [1]},
        {"attention": {"computed_fraction_all_steps": "x"}},
        {"method": "xy"},
        {"timing": {"total_s": 10**400}},
    ],
)
def test_a_sidecar_field_of_another_shape_makes_it_damaged(damage):
    record = {"schema": 1, "id": "a", "status": "done", "timing": {"total_s": 1.0}}
    assert well_formed(record) and not well_formed({**record, **damage})


@pytest.mark.parametrize(
    "damage",
    [{"layout": [1]}, {"calibration": {"x": 1}}, {"timing": {"items_s": "x"}}, {"started_at": 5}, {"items": [5]}],
)
def test_a_task_report_of_another_shape_is_left_out_of_the_aggregate(runner, tmp_path, finished, damage):
    out = _copy(finished, tmp_path)
    report = json.loads((out / "report.json").read_text())
    reports = state_dir(out) / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "task-0.json").write_text(
        json.dumps({k: v for k, v in {**report, **damage}.items() if k != "aggregated_from"})
    )
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0 and "1 done" in result.stdout, result.stderr[-2000:]
    assert json.loads((out / "report.json").read_text())["aggregated_from"] == [], "the damaged one is not read"


@pytest.mark.parametrize(
    "beat",
    [
        {"updated": float("nan")},
        {"updated": -1e400},
        {"updated": 10**400},
        {"pid": 10**21},
        {"s_per_step": 1.0, "eta_item_s": float("inf"), "item_index": 1},
    ],
)
def test_status_of_a_damaged_heartbeat(runner, tmp_path, finished, beat):
    out = _copy(finished, tmp_path)
    data = {"state": "running", "updated": time.time(), "host": socket.gethostname(), "pid": 1, **beat}
    (state_dir(out) / "progress" / "report.json").write_text(json.dumps(data))
    result = runner.invoke(app, ["status", str(out)])
    assert result.exit_code == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert HEARTBEAT(data) == ("eta_item_s" in beat)  # the time fields decide; a bad ETA only hides the ETA


@pytest.mark.parametrize("pid", [10**23, 0, -1])
def test_a_lock_no_process_can_hold_is_stale(runner, tmp_path, finished, pid):
    out = _copy(finished, tmp_path)
    (state_dir(out) / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    assert runner.invoke(app, ["status", str(out)]).exit_code == 0
    result = runner.invoke(app, ["generate", "--prompt", f"a cat {MARKUP}", "--out", str(out), *FAST_ARGV])
    assert result.exit_code == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--height", "0"], "simulate: height must be a positive multiple of 16"),
        (["--width", "7"], "simulate: width must be a positive multiple"),
        (["--frames", "2"], "simulate: frames must be 4k+1"),
        (["--steps", "1" + "0" * 20], "simulate: steps must be in [1, 1000]"),
        (["--nodes", "1" + "0" * 20], "--nodes and --gpus-per-node must be >= 1 and price at most 1024 GPUs"),
        (["--gpus", "0"], "must be >= 1"),
        (["--parallel", ",,"], "--parallel ',,' names no strategy"),
        (["--nodes", "1", "--parallel", "ditango", "--group-size", "3"], "nothing to price: ditango on 1 node(s): "),
        (["--parallel", "ditango", "--group-size", "²"], "--group-size must be a number of ranks or 'node'"),
        (["--plan", "/nonexistent/report.json"], "no such file"),
    ],
)
def test_simulate_prices_only_what_a_run_could_make(runner, args, needle):
    one_error(runner.invoke(app, ["simulate", *args]), needle)


@pytest.mark.parametrize(
    ("report", "needle"),
    [
        ([1], "not a report of ditango"),
        ({"items": [5]}, "not a report of ditango"),
        ({"items": [{"attention": {"per_step": ["x"]}}]}, "attention.per_step must list fractions in [0, 1]"),
        ({"items": [{"attention": {"per_step": [5.0]}}]}, "attention.per_step must list fractions"),
        ({"items": [{"attention": {"per_step": [0.5], "own_group": "weird"}}]}, "own_group must be one of"),
        (
            {"items": [{"attention": {"per_step": [0.5], "plan_file": "p.json"}}], "options": {"cache_ratio": "abc"}},
            "options.cache_ratio 'abc' is not a run's",
        ),
        ({"items": [{"attention": {"per_step": [0.5], "plan_file": "p.json"}}]}, "is not a DiTango plan file"),
    ],
)
def test_a_plan_of_another_shape(runner, tmp_path, report, needle):
    (tmp_path / "p.json").write_text('{"unit_offsets": [[1]]}')
    (tmp_path / "report.json").write_text(json.dumps(report))
    one_error(runner.invoke(app, ["simulate", "--nodes", "2", "--plan", str(tmp_path / "report.json")]), needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mem", "abc"], "--mem 'abc': sbatch takes a size"),
        (["--mem=-1G"], "--mem '-1G'"),
        (["--partition="], "--partition is empty"),
        (["--constraint", " "], "--constraint is empty"),
        (["--slurm-arg", "output=/etc/x"], "--slurm-arg output: ditango sets it"),
        (["--slurm-arg", "nodes=3"], "--slurm-arg nodes: ditango sets it from --nodes"),
        (["--slurm-arg", "time=5"], "--slurm-arg time: use --time"),
    ],
)
def test_slurm_values_sbatch_would_refuse_or_that_move_the_logs(runner, tmp_path, args, needle):
    one_error(runner.invoke(app, ["check", "--prompt", "a", "--device", "cpu", "--executor", "slurm", *args]), needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--vae-tile", "64"], "--vae-tile only applies to a tiled decode"),
        (["--step-cache", "first-block:threshold=0.1,threshold=0.2"], "threshold is given twice"),
        (["--model", ""], "--model is empty"),
        (
            ["--model-root", "/nonexistent/models", "--model", "wan2.1-1.3b"],
            "--model-root /nonexistent/models: not a folder",
        ),
        (["--model", "acme/video", "--revision", "main\nx"], "--revision 'main\\nx': a revision has no spaces"),
        (["--gpu-memory", "1.5PiB"], "at most 1PiB"),
    ],
)
def test_options_once_ignored_or_taken_as_something_else(runner, tmp_path, args, needle):
    one_error(
        runner.invoke(app, ["check", "--prompt", "a", "--device", "cpu", "--out", str(tmp_path / "o"), *args]), needle
    )
    assert not (tmp_path / "o").exists()


def test_a_run_file_cannot_say_how_to_show_a_run(runner, tmp_path):
    for text, key in [
        ("[run]\ndry_run = true\n", "dry_run"),
        ('config = "other.toml"\n', "config"),
        ("[run]\nquiet = true\n", "quiet"),
    ]:
        (tmp_path / "run.toml").write_text(text)
        result = runner.invoke(
            app, ["generate", "--prompt", "a", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "o")]
        )
        one_error(result, f"{key!r} is not a run setting; give --{key.replace('_', '-')} on the command line")
    assert not (tmp_path / "o").exists()


def test_an_out_that_is_a_symlink_loop_and_a_size_of_one_pib(runner, tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    one_error(
        runner.invoke(app, ["check", "--prompt", "a", "--device", "cpu", "--out", str(tmp_path / "a")]),
        "is a symbolic link to nothing",
    )
    ok = runner.invoke(app, ["check", "--prompt", "a", "--device", "cpu", "--gpu-memory", "1PiB"])
    assert ok.exit_code == 0, ok.stderr


def test_models_says_a_missing_root(runner):
    one_error(runner.invoke(app, ["models", "--model-root", "/nonexistent/models"]), "not a folder")
