"""Against a real Slurm: `bash scripts/local-slurm.sh start` (4 nodes on this host; .ci/run
starts it). Without a running cluster these tests skip, except in CI, where they fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from ditango_cli.app import app


def cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and "idle" in out.stdout


pytestmark = pytest.mark.skipif(
    not os.environ.get("CI") and not cluster_up(), reason="no local Slurm (bash scripts/local-slurm.sh start)"
)
SMALL = ["--steps", "3", "--height", "32", "--width", "64", "--frames", "5", "--device", "cpu", "--quiet",
         "--partition", "debug", "--executor", "slurm"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _require_cluster():
    assert cluster_up(), "Slurm is not running: .ci/run must start scripts/local-slurm.sh"


def test_two_nodes_two_tasks_match_the_local_run(runner, tmp_path):
    base = ["generate", "--prompt", "a green circle moving up", "--save-latents", "--gpus", "2", "--nodes", "2",
            "--parallel", "ring", *SMALL]  # fmt: skip
    result = runner.invoke(app, [*base, "--out", str(tmp_path / "slurm")])
    assert result.exit_code == 0, result.stderr
    local = [a if a != "slurm" else "local" for a in base]
    assert runner.invoke(app, [*local, "--out", str(tmp_path / "local")]).exit_code == 0
    # Inside an allocation (salloc sets SLURM_JOB_ID) the default executor starts the ranks
    # with srun in that allocation instead of submitting a new job.
    auto = [a if a != "slurm" else "auto" for a in base]
    cli = [sys.executable, "-c", "from ditango_cli.app import main; main()"]
    alloc = ["salloc", "--nodes", "2", "--ntasks-per-node", "2", "--partition", "debug", "--time", "5"]
    run = subprocess.run(
        [*alloc, *cli, *auto, "--out", str(tmp_path / "srun")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "srun" / "jobs.json").exists()  # nothing was submitted
    b = load_file(next((tmp_path / "local").glob("*.latents.safetensors")))["latents"]
    for name in ("slurm", "srun"):
        a = load_file(next((tmp_path / name).glob("*.latents.safetensors")))["latents"]
        assert (a - b).abs().max().item() <= 1e-4, name
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["layout"]["nodes"] == 2 and report["items"][0]["comm"]["inter_node_bytes"] > 0


def test_array_of_two_makes_four_videos_and_one_report(runner, tmp_path):
    prompts = tmp_path / "batch.txt"
    prompts.write_text("".join(f"a {c} square moving left\n" for c in ("red", "green", "blue", "white")))
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--prompts", str(prompts), "--out", str(out), "--array", "2", *SMALL])
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 4
    report = json.loads((out / "report.json").read_text())
    assert report["counts"]["done"] == 4 and report["aggregated_from"] == ["report.task-0.json", "report.task-1.json"]
    jobs = json.loads((out / "jobs.json").read_text())
    assert len(jobs[0]["job_ids"]) == 2  # one array, two tasks
    shown = runner.invoke(app, ["report", str(out)])
    assert shown.exit_code == 0 and "4 done" in shown.stdout


def test_replicas_over_two_nodes_share_the_items(runner, tmp_path):
    """--nodes 2 --replicas 2: one job of 2 tasks, two independent replicas (one per node)."""
    prompts = tmp_path / "batch.txt"
    prompts.write_text("".join(f"a {c} circle moving right\n" for c in ("red", "green", "blue")))
    out = tmp_path / "out"
    args = ["generate", "--prompts", str(prompts), "--out", str(out), "--nodes", "2", "--replicas", "2", *SMALL]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 3
    shares = [json.loads((out / f"report.task-0.replica-{r}.json").read_text()) for r in (0, 1)]
    assert [len(s["items"]) for s in shares] == [2, 1]
    assert json.loads((out / "report.json").read_text())["counts"]["done"] == 3
    assert json.loads((out / "jobs.json").read_text())[0]["tasks"] == 2


def test_cancel_and_resubmit_skips_finished_items(runner, tmp_path):
    prompts = tmp_path / "batch.txt"
    colours = ("red", "green", "blue", "yellow", "white")
    prompts.write_text("".join(f"a {c} ball moving {d}\n" for c in colours for d in ("down", "up")))
    out = tmp_path / "out"
    # Full-size items (~2 s each) so that cancelling after the first one leaves most undone.
    args = ["generate", "--prompts", str(prompts), "--out", str(out), "--device", "cpu", "--quiet",
            "--partition", "debug", "--executor", "slurm"]  # fmt: skip
    result = runner.invoke(app, [*args, "--no-wait"])
    assert result.exit_code == 0 and "submitted job" in result.stdout

    def finished_items() -> list:
        return [p for p in out.glob("*.mp4") if '"status": "done"' in _text(out / f"{p.stem}.json")]

    deadline = time.monotonic() + 120
    while not finished_items() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert runner.invoke(app, ["cancel", str(out)]).exit_code == 0
    time.sleep(2)  # a cancelled job's last write, if any, lands before we look
    finished = {p.stem: p.stat().st_mtime_ns for p in finished_items()}
    assert finished and len(finished) < 10
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 10
    for stem, mtime in finished.items():  # not redone
        assert (out / f"{stem}.mp4").stat().st_mtime_ns == mtime
    task = json.loads((out / "report.task-0.json").read_text())
    assert sum(i["status"] == "skipped" for i in task["items"]) >= len(finished)


def test_failing_task_fails_the_job_with_its_error(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "1:2")  # sbatch exports the environment to the job
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red ball", "--out", str(out), "--gpus", "2", "--retries", "0", *SMALL]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "injected fault on rank 1 after step 2" in result.stderr
    deadline = time.monotonic() + 60  # accounting may lag the job's end by a few seconds
    while True:
        status = runner.invoke(app, ["status", str(out)])
        if status.exit_code == 1 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert status.exit_code == 1 and "FAILED" in status.stdout and "injected fault" in status.stdout


def test_a_failed_item_is_retried_in_a_new_submission(runner, tmp_path, monkeypatch):
    """--retries 1 and a fault that fires once: the first job fails, the waiting command
    resubmits, the item is generated, and status then reports the batch as fine."""
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "1:2")
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(tmp_path / "fired"))
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red ball", "--out", str(out), "--gpus", "2", "--retries", "1", *SMALL]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "fired").exists()
    assert len(json.loads((out / "jobs.json").read_text())) == 2  # the failed submission and the retry
    (sidecar,) = [p for p in out.glob("*.json") if p.name not in ("jobs.json", "report.json") and "task" not in p.name]
    assert json.loads(sidecar.read_text())["status"] == "done"
    deadline = time.monotonic() + 60  # accounting may lag the job's end by a few seconds
    while True:
        status = runner.invoke(app, ["status", str(out)])
        if status.exit_code == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert status.exit_code == 0 and "FAILED" in status.stdout and "injected fault" in status.stdout


def test_time_limit_requeues_and_finishes_the_batch(runner, tmp_path):
    """2-minute limit, about 2.5 minutes of work (45 items of 90 steps, ~3.5 s each): Slurm signals 30 s before
    the limit, submitit checkpoints (requeues the same call) and the requeued job skips what
    was finished."""
    prompts = tmp_path / "batch.txt"
    colours = ("red", "green", "blue", "yellow", "white")
    lines = [
        f"a {c} {s} moving {d}" for c in colours for s in ("circle", "square") for d in ("left", "right", "up", "down")
    ]
    prompts.write_text("\n".join((lines * 2)[:45]) + "\n")  # ids differ by index
    out = tmp_path / "out"
    args = ["generate", "--prompts", str(prompts), "--out", str(out), "--device", "cpu", "--quiet",
            "--partition", "debug", "--executor", "slurm", "--time", "2", "--steps", "90"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 45
    task = json.loads((out / "report.task-0.json").read_text())
    skipped = sum(i["status"] == "skipped" for i in task["items"])
    assert 0 < skipped < 45  # the last (requeued) run resumed: it found finished items


def _text(path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""
