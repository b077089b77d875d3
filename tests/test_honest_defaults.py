"""Defaults that fit the headline job, outputs that are never mislabelled, and a CLI that can
be read: DiTango's group on several nodes, one set of defaults for `simulate` and
`generate`, a video's making in its identity, run files that travel, whole tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ditango_cli.app import app
from planner.layout import ParallelLayout

from .conftest import FAST_ARGV

ROOT = Path(__file__).resolve().parent.parent
HEADLINE = ["--model", "wan2.1-14b", "--nodes", "4", "--gpus-per-node", "8", "--parallel", "ditango"]


@pytest.mark.parametrize(
    ("nodes", "gpus", "cfg", "group"),
    [(4, 8, 1, 8), (4, 8, 2, 8), (2, 4, 1, 4), (2, 3, 1, 3), (3, 2, 1, 2), (1, 8, 1, 2), (1, 3, 1, 1)],
)
def test_ditangos_default_group_is_a_node_on_several_nodes(nodes, gpus, cfg, group):
    assert ParallelLayout(nodes, gpus, cfg, "ditango").group == group
    assert ParallelLayout(nodes, gpus, cfg, "ditango", group_size=1).group == 1  # as given


def test_the_default_moves_no_more_inter_node_bytes_than_the_ring(runner):
    """The bug: pairs on 4 x 8 GPUs moved 17,689 GB between nodes against the ring's 10,409."""
    result = runner.invoke(app, ["simulate", "--nodes", "4", "--gpus-per-node", "8", "--json"])
    assert result.exit_code == 0, result.stderr
    rows = {(r["strategy"], r["nodes"]): r for r in json.loads(result.stdout)["rows"]}
    for nodes in (2, 3, 4):
        assert rows["ditango", nodes]["inter_node_bytes"] <= rows["ring", nodes]["inter_node_bytes"], nodes
        assert rows["ditango", nodes]["ditango"]["group_size"] == 8
    assert rows["ditango", 1]["ditango"]["group_size"] == 2  # as generate on one node


def test_simulate_and_the_dry_run_agree_on_every_default(runner, tmp_path):
    sim = runner.invoke(app, ["simulate", *HEADLINE, "--json"])
    assert sim.exit_code == 0, sim.stderr
    assumptions = json.loads(sim.stdout)["assumptions"]
    row = next(r for r in json.loads(sim.stdout)["rows"] if r["strategy"] == "ditango" and r["nodes"] == 4)
    dry = runner.invoke(
        app,
        [
            "generate",
            *HEADLINE,
            "--prompt",
            "a cat",
            "--executor",
            "slurm",
            "--dry-run",
            "--json",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert dry.exit_code == 0, dry.stderr
    shown = json.loads(dry.stdout)
    assert shown["layout"]["group_size"] == row["ditango"]["group_size"] == 8
    assert shown["ditango"]["planner"]["cache_ratio"] == assumptions["ditango_cache_ratio"]
    assert shown["ditango"]["planner"]["planner"] == assumptions["ditango_planner"]
    assert (shown["ditango"]["planner"]["warmup"], shown["ditango"]["planner"]["cooldown"]) == (
        assumptions["ditango_warmup"],
        assumptions["ditango_cooldown"],
    )
    (first,) = shown["item_list"]
    assert (first["height"], first["width"], first["frames"], first["steps"]) == (
        assumptions["height"],
        assumptions["width"],
        assumptions["frames"],
        assumptions["steps"],
    )
    text = runner.invoke(
        app, ["generate", *HEADLINE, "--prompt", "a", "--executor", "slurm", "--dry-run", "--out", str(tmp_path / "o")]
    )
    assert "strategy ditango (group size 8)" in text.stdout


def test_plan_item_picks_and_names_the_replayed_item(runner, tmp_path):
    from .test_cost_model import OWN_PLAN

    (tmp_path / "b.plan.json").write_text(json.dumps({"schema": 1, **OWN_PLAN}))
    attention = {"per_step": [1.0, 0.5], "planner": "hpdc", "own_group": "decide"}
    items = [
        {"id": "a", "attention": {**attention, "per_step": [1.0, 1.0]}},
        {"id": "b", "attention": {**attention, "plan_file": "b.plan.json"}},
    ]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"options": {"cache_ratio": 0.5}, "items": items}))
    args = ["simulate", "--nodes", "2", "--gpus-per-node", "8", "--plan", str(report), "--json"]
    first = json.loads(runner.invoke(app, args).stdout)["assumptions"]["ditango_plan"]
    assert "item a" in first and "no plan file" in first
    chosen = json.loads(runner.invoke(app, [*args, "--plan-item", "b"]).stdout)["assumptions"]["ditango_plan"]
    assert "item b" in chosen and "plan file's shape" in chosen
    missing = runner.invoke(app, [*args, "--plan-item", "c"])
    assert missing.exit_code == 2 and "its DiTango items: a, b" in missing.stderr
    alone = runner.invoke(app, ["simulate", "--plan-item", "a"])
    assert alone.exit_code == 2 and "--plan-item only applies with --plan" in alone.stderr


def test_a_video_made_another_way_is_not_skipped_under_this_ones_name(runner, tmp_path):
    """The bug: a step cache (or DiTango's reuse) into a folder of exact videos skipped them and
    rewrote the report under the new settings. The making is part of an item's identity."""
    out = tmp_path / "out"
    base = ["generate", "--prompt", "a red circle", "--out", str(out), *FAST_ARGV]
    assert runner.invoke(app, base).exit_code == 0
    (sidecar,) = [p for p in out.glob("*.json") if p.name != "report.json"]
    assert json.loads(sidecar.read_text())["method"] == {}
    cached = [*base, "--step-cache", "first-block:threshold=0.05"]
    refused = runner.invoke(app, cached)
    assert refused.exit_code == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "was made with none, not step_cache" in line and "--overwrite" in line
    assert runner.invoke(app, [*cached, "--overwrite"]).exit_code == 0
    assert json.loads(sidecar.read_text())["method"]["step_cache"]["name"] == "first-block"
    again = runner.invoke(app, cached)  # the same making: skipped
    assert again.exit_code == 0 and json.loads((out / "report.json").read_text())["counts"]["skipped"] == 1
    back = runner.invoke(app, base)
    assert back.exit_code == 2 and "was made with step_cache" in back.stderr and "not none" in back.stderr


def test_run_file_paths_are_relative_to_the_file_and_reports_replay_from_anywhere(runner, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "batch.txt").write_text("a red circle\n")
    (folder / "run.toml").write_text('prompts = "batch.txt"\nout = "results"\nsteps = 3\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    fast = [a for a in FAST_ARGV if a not in ("--steps", "3")]
    result = runner.invoke(app, ["generate", "--config", str(folder / "run.toml"), *fast])
    assert result.exit_code == 0, result.stderr
    report = json.loads((folder / "results" / "report.json").read_text())
    assert report["options"]["prompts"] == str(folder / "batch.txt") and report["options"]["out"] == str(
        folder / "results"
    )
    monkeypatch.chdir(tmp_path)  # a report replays from any folder, into another --out
    replay = runner.invoke(
        app,
        ["generate", "--config", str(folder / "results" / "report.json"), "--out", str(tmp_path / "again"), "--quiet"],
    )
    assert replay.exit_code == 0, replay.stderr
    assert json.loads((tmp_path / "again" / "report.json").read_text())["counts"]["done"] == 1


def test_tables_keep_ids_names_and_numbers_whole_at_80_columns(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    models = runner.invoke(app, ["models"])
    assert models.exit_code == 0
    from runtime.models.registry import REGISTRY

    for spec in REGISTRY.values():
        assert spec.name in models.stdout and (spec.repo_id is None or spec.repo_id in models.stdout), spec.name
    sim = runner.invoke(app, ["simulate"])
    data = json.loads(runner.invoke(app, ["simulate", "--json"]).stdout)
    for r in data["rows"]:
        for value in (
            f"{r['inter_node_bytes'] / 1e9:.1f}",
            f"{r['intra_node_bytes'] / 1e9:.1f}",
            f"{r['e2e_s']:.1f}",
            r["strategy"],
        ):
            assert value in sim.stdout, value
    assert "…" not in models.stdout + sim.stdout
    out = tmp_path / "out"  # a report with ids longer than a narrow column
    batch = tmp_path / "b.jsonl"
    ids = ["an-item-id-that-is-long-enough-to-be-cut-at-eighty-columns", "another-long-identifier-of-an-item-0042"]
    batch.write_text("".join(json.dumps({"id": i, "prompt": "a red circle"}) + "\n" for i in ids))
    assert runner.invoke(app, ["generate", "--prompts", str(batch), "--out", str(out), *FAST_ARGV]).exit_code == 0
    shown = runner.invoke(app, ["report", str(out)])
    assert shown.exit_code == 0 and all(i in shown.stdout for i in ids) and "…" not in shown.stdout
    assert "tiny-wan: 1 rank(s) on 1 node(s), strategy none" in shown.stdout


def test_status_tables_keep_job_ids_whole(runner, tmp_path, monkeypatch):
    import slurm.job_errors
    from runtime.outputs import state_dir

    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    (state_dir(out) / "jobs.json").write_text(
        json.dumps(
            [{"submitted_at": "20261203T093000123456", "folder": "/x", "job_ids": ["123456789012_3"], "tasks": 1}]
        )
    )
    row = {
        "job_id": "123456789012_3",
        "state": "FAILED",
        "submitted_at": "20261203T093000123456",
        "cancelled": False,
        "error": "rank 3: RuntimeError: a long error that wraps over several lines of an eighty-column terminal",
    }
    monkeypatch.setattr(slurm.job_errors, "job_states", lambda out_dir: [row])
    shown = runner.invoke(app, ["status", str(out)])
    assert "123456789012_3" in shown.stdout and "2026-12-03 09:30:00 UTC" in shown.stdout, shown.stdout
    assert "report: none yet; `ditango report" in shown.stdout
    assert shown.exit_code == 1  # a failed job


def test_status_merges_the_report_once_every_job_has_ended(runner, tmp_path, monkeypatch):
    """Jobs submitted without --wait: while one is live the report is left to them; once all
    have ended, status merges their task reports into report.json itself (and again only when
    a task report is newer than it)."""
    import slurm.job_errors
    from runtime.outputs import state_dir

    out = tmp_path / "out"
    (state_dir(out) / "reports").mkdir(parents=True)
    (state_dir(out) / "jobs.json").write_text(
        json.dumps([{"submitted_at": "20261203T093000123456", "folder": "/x", "job_ids": ["7_0", "7_1"], "tasks": 2}])
    )
    for task, item in enumerate(("a", "b")):
        report = {"schema": 1, "started_at": f"2026-12-03T09:3{task}:00", "layout": {"nodes": 1}}
        report["items"] = [{"schema": 1, "id": item, "status": "done"}]
        (state_dir(out) / "reports" / f"task-{task}.json").write_text(json.dumps(report))
    states = {"7_0": "COMPLETED", "7_1": "RUNNING"}

    def rows(out_dir):
        return [
            {"job_id": j, "state": s, "submitted_at": "20261203T093000123456", "cancelled": False, "error": None}
            for j, s in states.items()
        ]

    monkeypatch.setattr(slurm.job_errors, "job_states", rows)
    live = runner.invoke(app, ["status", str(out)])
    assert live.exit_code == 0 and "report: none yet" in live.stdout and not (out / "report.json").exists()
    states["7_1"] = "COMPLETED"
    ended = runner.invoke(app, ["status", str(out)])
    said = " ".join(ended.stdout.split())
    assert ended.exit_code == 0 and f"report: {out / 'report.json'} (merged now: every job has ended)" in said
    merged = json.loads((out / "report.json").read_text())
    assert merged["counts"]["done"] == 2 and [i["id"] for i in merged["items"]] == ["a", "b"]
    again = runner.invoke(app, ["status", str(out)])
    assert "merged now" not in again.stdout  # nothing newer to merge


def test_a_job_the_user_cancelled_is_said_so_and_its_item_interrupted(tmp_path, monkeypatch):
    import slurm.job_errors
    import slurm.jobs
    from runtime.outputs import state_dir, status_counts

    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    (state_dir(out) / "jobs.json").write_text(
        json.dumps([{"submitted_at": "20261203T093000123456", "folder": "/x", "job_ids": ["77"], "tasks": 1}])
    )
    slurm.jobs.record_cancelled(out, ["77"])
    monkeypatch.setattr(slurm.job_errors, "slurm_states", lambda ids: {"77": "CANCELLED by 1000"})
    (row,) = slurm.job_errors.job_states(out)
    assert row["cancelled"] and row["state"] == "CANCELLED" and row["error"].startswith("cancelled with `ditango")
    (out / "a.json").write_text(json.dumps({"schema": 1, "id": "a", "status": "running"}))
    assert status_counts(out, alive=False) == "0 done, 1 interrupted"
    assert status_counts(out) == "0 done, 1 running"


def test_a_heartbeat_whose_process_is_gone_reads_stopped():
    import socket

    from runtime.progress import heartbeat_line

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    data = {"state": "running", "updated": 0.0, "host": socket.gethostname(), "pid": gone.pid, "item_index": 0}
    assert heartbeat_line(data, now=10.0).startswith(f"stopped: its process (pid {gone.pid}) is gone")
    assert heartbeat_line({**data, "pid": os.getpid()}, now=10.0).startswith("running: ")
    assert heartbeat_line({**data, "host": "another-host"}, now=10.0).startswith("running: ")


def _as_from_a_terminal() -> None:
    """The child as a shell starts it: SIGINT handled by default and not blocked. A child
    inherits ignored and blocked signals, and earlier tests' libraries in this process (pools
    of workers, process groups) may have left SIGINT so; the command would then not see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.e2e
def test_ctrl_c_says_what_is_kept_and_how_to_resume(tmp_path, ranks):
    """Ctrl-C reaches the foreground group: the launcher, which stops its local ranks (each in a
    session of its own); one line, exit 130, and no warning of leaked semaphores from them."""
    out = tmp_path / "out"
    cmd = [
        str(Path(sys.executable).parent / "ditango"),
        "generate",
        "--prompt",
        "a cat",
        "--out",
        str(out),
        "--steps",
        "400",
        "--height",
        "32",
        "--width",
        "64",
        "--frames",
        "5",
        "--device",
        "cpu",
        "--gpus",
        str(ranks),
        "--parallel",
        "ring" if ranks > 1 else "none",
    ]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_as_from_a_terminal
    )
    for line in proc.stderr:  # until it is denoising
        if "step " in line:
            break
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    (said,) = [ln for ln in rest.splitlines() if ln.startswith("interrupted:")]
    assert f"{out} keeps what finished (0 done, 1 interrupted); the same command resumes the rest" in said
    assert "Traceback" not in rest and "leaked" not in rest


def test_version_and_a_note_for_a_strategy_that_does_nothing(runner):
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.stdout.startswith("ditango ")
    check = runner.invoke(app, ["check", "--parallel", "ditango", "--prompt", "a cat", "--device", "cpu"])
    assert check.exit_code == 0 and "note: --parallel ditango on 1 rank(s) splits no sequence" in check.stdout
    grammar = runner.invoke(app, ["check", "--prompt", "a", "--cache-ratio", "0.5", "--device", "cpu"])
    assert grammar.exit_code == 2 and "--cache-ratio only applies to --parallel ditango" in grammar.stderr


@pytest.mark.parametrize("own_group", ["decide", "fresh"])
def test_a_single_ditango_group_says_what_its_own_group_option_does(runner, own_group):
    """One group of 2 ranks: under --own-group decide (the default) the other rank's partitions
    may be reused (a run reused 28% of its attention so), under fresh nothing is."""
    base = ["check", "--parallel", "ditango", "--gpus", "2", "--group-size", "2", "--prompt", "a cat"]
    result = runner.invoke(app, [*base, "--device", "cpu", "--own-group", own_group])
    assert result.exit_code == 0, result.stderr
    said = " ".join(result.stdout.split())  # the console wraps at its width
    note = said[said.index("note: --parallel ditango") :]
    if own_group == "fresh":
        assert "--own-group fresh computes every partition fresh (nothing is reused)" in note
    else:
        assert "reuses only the partitions of the group's other ranks (--own-group decide" in note
        assert "nothing is reused" not in said


def test_the_examples_are_runs_generate_accepts(runner, tmp_path):
    """examples/: a first run on the built-in model, and the headline cluster run file (its
    cluster options overridden on the command line, which wins), checked with their batches."""
    tiny = runner.invoke(app, ["check", "--config", str(ROOT / "examples" / "tiny.toml")])
    assert tiny.exit_code == 0 and "ok: 2 item(s)" in tiny.stdout, tiny.stderr
    cluster = runner.invoke(
        app,
        [
            "check",
            "--config",
            str(ROOT / "examples" / "run.toml"),
            "--model",
            "tiny-wan",
            "--nodes",
            "1",
            "--gpus",
            "1",
            "--executor",
            "local",
            "--device",
            "cpu",
            "--height",
            "64",
            "--width",
            "64",
            "--frames",
            "17",
            "--steps",
            "2",
        ],
    )
    assert cluster.exit_code == 0 and "ok: 3 item(s)" in cluster.stdout, cluster.stderr


def test_local_cpu_ranks_can_be_named_ranks(runner):
    """--ranks: --gpus-per-node's name for local processes on CPUs, the same option."""
    base = ["check", "--prompt", "a cat", "--device", "cpu", "--parallel", "ring", "--json"]
    ranks, gpus = (json.loads(runner.invoke(app, [*base, flag, "2"]).stdout) for flag in ("--ranks", "--gpus"))
    assert ranks["layout"] == gpus["layout"] and ranks["layout"]["world_size"] == 2


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_help_fits_the_terminal_and_shows_every_option_name_whole(runner, columns):
    """Below 120 columns typer's panels cut option names (`--cache-memory-l…`): --help is click's
    plain layout there, the panels on a wider terminal; no line is wider than the terminal, no
    name is cut, and a flag shows no `<bool>` placeholder as if it took a value."""
    from ditango_cli.manual import commands

    for name, command, ctx in commands(app):
        shown = runner.invoke(app, [*name.split(), "--help"], env={"COLUMNS": str(columns)})
        assert shown.exit_code == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert max(len(ln) for ln in lines) <= columns, (name, columns)
        assert "<bool>" not in shown.stdout and "…" not in shown.stdout, (name, columns)
        assert ("╭" in shown.stdout) == (columns >= 120), (name, columns)  # panels only where they fit
        words = set(shown.stdout.replace(",", " ").replace("/", " ").split())
        for param in command.params:
            if param.param_type_name == "option" and param.get_help_record(ctx) is not None:
                assert set(param.opts + param.secondary_opts) <= words, (name, param.opts)


def test_a_table_wider_than_the_terminal_is_stacked_not_cut(runner):
    """simulate's ranking is 169 columns wide: in a 100-column terminal each row is stacked
    (its rank, then `header: value` lines), nothing cut; at 200 columns it stays a table."""
    args = ["simulate", "--model", "wan2.1-14b", "--nodes", "4", "--gpus-per-node", "8", "--batch", "50"]
    narrow = runner.invoke(app, args, env={"COLUMNS": "100"})
    assert narrow.exit_code == 0, narrow.stderr
    assert max(len(ln) for ln in narrow.stdout.splitlines()) <= 100
    flags = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["ranking"][0]["flags"]
    assert f"  generate flags: {' '.join(flags)}" in narrow.stdout.splitlines() and "…" not in narrow.stdout
    wide = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert "┃ layout" in wide.stdout and "  generate flags:" not in wide.stdout
