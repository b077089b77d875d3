"""Slurm layer without Slurm: submitit parameters (golden file), executor choice, sharding,
and prompts that must never be touched by a shell."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from basics.errors import ConfigError
from planner.layout import ParallelLayout
from runtime.config import Item, RunConfig
from slurm.options import SlurmOptions, choose_executor, submitit_parameters
from slurm.sharding import replica_of, shard

GOLDEN = Path(__file__).parent / "golden" / "submitit_params.json"


def config(nodes: int, gpus: int) -> RunConfig:
    item = Item("a", "a red circle", "", 0, 480, 832, 81, 50, 5.0)
    return RunConfig(
        "wan2.1-14b", Path("/models/wan"), (item,), Path("/out"), layout=ParallelLayout(nodes, gpus, strategy="ring")
    )


def rendered() -> dict:
    full = SlurmOptions(
        partition="gpu",
        account="proj",
        qos="high",
        time_min=90,
        cpus_per_task=8,
        mem="200G",
        constraint="h100",
        extra=SlurmOptions.parse_extra(["exclusive=user", "--mail_type=END"]),
        job_name="batch",
        array=8,
        array_parallelism=2,
    )
    # A config with the host memory build_run_config records (planner/host_memory.py): --mem from
    # it unless given; --cpus-per-task 8 unless given (test_host_memory.py derives 120641751450).
    recorded = replace(config(1, 8), host_memory=120_641_751_450)
    return {
        "full_4x8_gpus": submitit_parameters(config(4, 8), full, use_gpus=True),
        "default_2x2_cpu": submitit_parameters(config(2, 2), SlurmOptions(), use_gpus=False),
        "recorded_host_memory_1x8_gpus": submitit_parameters(recorded, SlurmOptions(), use_gpus=True),
        "recorded_host_memory_given_mem_exclusive": submitit_parameters(
            recorded, SlurmOptions(mem="300G", cpus_per_task=12, exclusive=True), use_gpus=True
        ),
    }


def test_submitit_parameters_match_golden_file():
    """Regenerate with DITANGO_UPDATE_GOLDEN=1 after an intended change, and review the diff."""
    if os.environ.get("DITANGO_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(rendered(), indent=2, sort_keys=True) + "\n")
    assert rendered() == json.loads(GOLDEN.read_text())


def test_bad_options():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        SlurmOptions.parse_extra(["exclusive"])
    with pytest.raises(ConfigError, match="--time"):
        SlurmOptions(time_min=0)
    with pytest.raises(ConfigError, match="--array"):
        SlurmOptions(array=0)
    with pytest.raises(ConfigError, match="sbatch option name"):
        SlurmOptions(extra=(("rm -rf /", "x"),))
    # A newline in a value would end its #SBATCH line and start a shell line of its own.
    with pytest.raises(ConfigError, match="--partition 'debug.nrm -rf /': control characters"):
        SlurmOptions(partition="debug\nrm -rf /")
    with pytest.raises(ConfigError, match="--slurm-arg comment"):
        SlurmOptions(extra=(("comment", "a\tb"),))


def test_auto_executor(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    assert choose_executor("auto", 4, SlurmOptions(partition="gpu")) == "local"
    with pytest.raises(ConfigError, match="sbatch is not on PATH"):
        choose_executor("slurm", 1, SlurmOptions())
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert choose_executor("auto", 4, SlurmOptions()) == "sbatch"
    assert choose_executor("auto", 1, SlurmOptions()) == "local"
    assert choose_executor("auto", 1, SlurmOptions(array=2)) == "sbatch"
    assert choose_executor("local", 4, SlurmOptions()) == "local"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert choose_executor("auto", 1, SlurmOptions()) == "srun"


def test_sharding_is_a_partition():
    items = list(range(11))
    shards = [shard(items, i, 3) for i in range(3)]
    assert sorted(x for s in shards for x in s) == items
    assert [len(s) for s in shards] == [4, 4, 3]
    assert shard(items, 1, 3) == [1, 4, 7, 10]
    with pytest.raises(ValueError):
        shard(items, 3, 3)
    assert [replica_of(r, 8, 2) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    with pytest.raises(ConfigError, match="must divide"):
        replica_of(0, 6, 4)


def test_hostile_prompts_round_trip_unchanged(runner, tmp_path):
    """Prompts never reach a shell: quotes, $(...), backticks, newlines, unicode, 2,000 chars."""
    from ditango_cli.app import app

    hostile = [
        'it\'s "quoted" $(rm -rf /) `reboot` ; echo pwned && exit 1 | cat > /tmp/x',
        "two\nlines\r\nand a tab\t and a NUL-free bell \a",
        "单词 ünïcödé ✓ 🎬 " + "x" * 1970,
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in hostile))
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompts",
        str(f),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
        "--steps",
        "1",
        "--height",
        "16",
        "--width",
        "16",
        "--frames",
        "1",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert [i["prompt"] for i in report["items"]] == hostile
    for item in report["items"]:
        assert (out / f"{item['id']}.mp4").is_file()
        assert all(c.isalnum() or c == "-" for c in item["id"])


def test_rendered_names_are_sbatch_parameters():
    """Every key must be a parameter submitit renders into #SBATCH lines (catches typos)."""
    import inspect

    from submitit.slurm.slurm import _make_sbatch_string

    valid = set(inspect.signature(_make_sbatch_string).parameters)
    for params in rendered().values():
        assert set(params) <= valid, set(params) - valid


def test_aggregate_task_reports_and_sidecars(tmp_path):
    from slurm.aggregate import aggregate

    def record(item_id, status, **extra):
        return {"schema": 1, "id": item_id, "status": status, **extra}

    reports = tmp_path / ".ditango" / "reports"
    reports.mkdir(parents=True)

    (reports / "task-0.json").write_text(
        json.dumps(
            {
                "schema": 1,
                "started_at": "2026-01-01T00:00:00",
                "layout": {"nodes": 2},
                "items": [record("a", "done"), record("b", "failed", error="boom")],
            }
        )
    )
    (reports / "task-1.json").write_text(
        json.dumps(
            {
                "schema": 1,
                "started_at": "2026-01-01T00:00:05",
                "items": [record("c", "skipped")],
            }
        )
    )
    for item_id in ("a", "c"):  # sidecars of finished items
        (tmp_path / f"{item_id}.json").write_text(json.dumps(record(item_id, "done")))
    # d: done long ago, skipped by the latest run (its report is newer than its sidecar)
    (tmp_path / "d.json").write_text(json.dumps(record("d", "done")))
    os.utime(tmp_path / "d.json", (1_000_000_000, 1_000_000_000))
    (reports / "task-2.json").write_text(
        json.dumps(
            {
                "schema": 1,
                "started_at": "2026-01-01T00:00:09",
                "items": [record("d", "skipped")],
            }
        )
    )
    (tmp_path / ".ditango" / "jobs.json").write_text("[]")
    merged = aggregate(tmp_path)
    statuses = [(i["id"], i["status"]) for i in merged["items"]]
    assert statuses == [("a", "done"), ("b", "failed"), ("c", "done"), ("d", "skipped")]
    assert merged["counts"] == {"done": 2, "skipped": 1, "failed": 1}
    assert merged["aggregated_from"] == [f".ditango/reports/task-{t}.json" for t in range(3)]
    again = aggregate(tmp_path)  # the aggregate itself is not an input
    assert again["items"] == merged["items"]
    assert json.loads((tmp_path / "report.json").read_text())["counts"] == merged["counts"]


def test_one_rank_on_a_node_of_the_allocation_runs_in_this_process(monkeypatch, tmp_path):
    """Bug: one rank from an `srun --pty bash` shell (or a batch script) started a nested srun
    step, which waits for the resources the shell's own step holds. From salloc's shell on the
    login host (no SLURMD_NODENAME) the rank still goes to the allocation with srun."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    assert choose_executor("auto", 1, SlurmOptions(), ranks=1) == "srun"
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    assert choose_executor("auto", 1, SlurmOptions(), ranks=1) == "local"
    assert choose_executor("auto", 1, SlurmOptions(), ranks=2) == "srun"
    assert choose_executor("slurm", 1, SlurmOptions(), ranks=1) == "srun"  # asked for: a step


def test_a_step_srun_cannot_start_is_one_line_after_the_setup_timeout(runner, tmp_path, monkeypatch):
    """Bug: inside an allocation whose resources another step holds, srun waited for them for ever
    ("Job step creation temporarily disabled") and the command with it."""
    import time

    from ditango_cli.app import app

    fake = tmp_path / "bin"
    fake.mkdir()
    srun = fake / "srun"
    srun.write_text(
        f"#!{sys.executable}\nimport sys, time\n"
        "sys.stderr.write('srun: Job step creation temporarily disabled, retrying (Requested nodes are busy)\\n')\n"
        "sys.stderr.flush()\ntime.sleep(600)\n"
    )
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "0")
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--gpus",
        "2",
        "--parallel",
        "ring",
        "--device",
        "cpu",
        "--quiet",
        "--timeout",
        "2",
        "--setup-timeout",
        "3",
    ]
    began = time.monotonic()
    result = runner.invoke(app, args)
    assert time.monotonic() - began < 60
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: srun could not start the step in 3 s (--setup-timeout): srun: Job step creation temporarily "
        "disabled, retrying (Requested nodes are busy)"
    )
    assert not (out / "slurm").exists()  # its folder goes with it


def test_no_wckey_unless_asked(tmp_path):
    """submitit writes --wckey=submitit by default, which clusters that enforce wckeys refuse: the
    script carries one only when --slurm-arg asks for it."""
    import submitit

    def script(opts: SlurmOptions) -> list[str]:
        executor = submitit.SlurmExecutor(folder=tmp_path)
        executor.update_parameters(**submitit_parameters(config(2, 2), opts, use_gpus=False))
        return [ln for ln in executor._make_submission_file_text("true", "uid").splitlines() if "--wckey" in ln]

    assert script(SlurmOptions()) == []
    assert script(SlurmOptions(extra=SlurmOptions.parse_extra(["wckey=proj"]))) == ["#SBATCH --wckey=proj"]
