"""Against a real Slurm: `bash scripts/local-slurm.sh start` (4 nodes on this host; .ci/run
starts it). Without a running cluster these tests skip, except in CI, where they fail."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ditango_cli.app import app
from tests.conftest import FAST_ARGV, cluster_up

pytestmark = pytest.mark.slurm
# What srun steps in an allocation take; a submission takes Slurm's job options besides.
STEPS = [*FAST_ARGV, "--executor", "slurm"]
SMALL = [*STEPS, "--partition", "debug"]


@pytest.fixture(scope="module", autouse=True)
def _require_cluster():
    assert cluster_up(), "Slurm is not running: .ci/run must start scripts/local-slurm.sh"


def test_two_nodes_two_tasks_match_the_local_run(runner, tmp_path):
    base = [
        "generate",
        "--prompt",
        "a green circle moving up",
        "--save-latents",
        "--gpus",
        "2",
        "--nodes",
        "2",
        "--parallel",
        "ring",
        *STEPS,
    ]
    result = runner.invoke(app, [*base, "--partition", "debug", "--out", str(tmp_path / "slurm")])
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
    assert not (tmp_path / "srun" / ".ditango" / "jobs.json").exists()  # nothing was submitted
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
    assert report["counts"]["done"] == 4 and report["aggregated_from"] == [
        ".ditango/reports/task-0.json",
        ".ditango/reports/task-1.json",
    ]
    jobs = json.loads((out / ".ditango" / "jobs.json").read_text())
    assert len(jobs[0]["job_ids"]) == 2  # one array, two tasks
    shown = runner.invoke(app, ["report", str(out)])
    assert shown.exit_code == 0 and "4 done" in shown.stdout


def test_replicas_over_two_nodes_share_the_items(runner, tmp_path):
    """--nodes 2 --replicas 2: one job of 2 tasks, two independent replicas (one per node), each
    taking items from the folder's queue."""
    prompts = tmp_path / "batch.txt"
    prompts.write_text("".join(f"a {c} circle moving right\n" for c in ("red", "green", "blue")))
    out = tmp_path / "out"
    args = ["generate", "--prompts", str(prompts), "--out", str(out), "--nodes", "2", "--replicas", "2", *SMALL]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 3
    shares = [json.loads((out / ".ditango" / "reports" / f"task-0.replica-{r}.json").read_text()) for r in (0, 1)]
    made = [i["id"] for s in shares for i in s["items"] if i["status"] == "done"]
    assert sorted(made) == sorted({*made}) and len(made) == 3  # the queue gave each item to one replica
    assert json.loads((out / "report.json").read_text())["counts"]["done"] == 3
    assert json.loads((out / ".ditango" / "jobs.json").read_text())[0]["tasks"] == 2


def test_an_array_and_a_joined_job_share_one_queue(runner, tmp_path):
    """A 3-task array and a 2-node job that joins it (`--join`) take items from one queue: every
    item is made once, and the report names the worker that made it (an array task's, or the
    joined job's)."""
    prompts = tmp_path / "batch.txt"
    prompts.write_text("".join(f"a {c} kite drifting, take {k}\n" for k in range(3) for c in ("red", "blue", "gray")))
    out = tmp_path / "out"
    slow = ["--steps", "12", "--height", "32", "--width", "64", "--frames", "9", "--device", "cpu", "--quiet"]
    first = ["generate", "--prompts", str(prompts), "--out", str(out), "--array", "3", *slow, "--executor", "slurm"]
    result = runner.invoke(app, [*first, "--partition", "debug", "--no-wait"])
    assert result.exit_code == 0, result.stderr
    join = ["generate", "--join", str(out), "--nodes", "2", "--executor", "slurm", "--partition", "debug"]
    result = runner.invoke(app, [*join, "--no-wait", "--quiet"])
    assert result.exit_code == 0, result.stderr
    jobs = [j for entry in json.loads((out / ".ditango" / "jobs.json").read_text()) for j in entry["job_ids"]]
    assert len(jobs) == 4  # 3 array tasks, 1 joined job
    deadline = time.monotonic() + 600
    while subprocess.run(["squeue", "-h", "-j", ",".join(jobs)], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the jobs did not end"
        time.sleep(1)
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    report = json.loads((out / "report.json").read_text())
    ids = [i["id"] for i in report["items"]]
    assert len(ids) == len(set(ids)) == 9 and report["counts"]["done"] == 9
    makers = {i["queue"]["label"] for i in report["items"]}
    assert all(json.loads((out / f"{i}.json").read_text())["queue"]["token"] == 1 for i in ids)
    workers = {w["label"]: w for w in report["queue"]["workers"]}
    assert makers <= set(workers) and len(workers) == 4, workers  # each task's worker, and the joined job's
    assert sum(w["done"] for w in workers.values()) == 9


def test_cancel_and_resubmit_skips_finished_items(runner, tmp_path):
    prompts = tmp_path / "batch.txt"
    colours = ("red", "green", "blue", "yellow", "white")
    prompts.write_text("".join(f"a {c} ball moving {d}\n" for c in colours for d in ("down", "up")))
    out = tmp_path / "out"
    # Full-size items (~2 s each) so that cancelling after the first one leaves most undone.
    args = [
        "generate",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
        "--partition",
        "debug",
        "--executor",
        "slurm",
    ]
    result = runner.invoke(app, [*args, "--no-wait"])
    assert result.exit_code == 0 and "submitted job" in result.stdout

    def finished_items() -> list:
        return [p for p in out.glob("*.mp4") if '"status": "done"' in _text(out / f"{p.stem}.json")]

    deadline = time.monotonic() + 120
    while not finished_items() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert runner.invoke(app, ["cancel", str(out)]).exit_code == 0
    time.sleep(2)  # a cancelled job's last write, if any, lands before we look
    # The user's cancel is no failure: said as such, no rank blamed, nothing left "running".
    status = runner.invoke(app, ["status", str(out)])
    flat = table_text(status.stdout)
    assert status.exit_code == 0 and "cancelled with `ditango cancel`" in flat, status.stdout
    (items,) = [ln for ln in status.stdout.splitlines() if ln.startswith("items in")]
    assert "running" not in items and "killed" not in status.stdout, status.stdout
    finished = {p.stem: p.stat().st_mtime_ns for p in finished_items()}
    assert finished and len(finished) < 10
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 10
    for stem, mtime in finished.items():  # not redone
        assert (out / f"{stem}.mp4").stat().st_mtime_ns == mtime
    task = json.loads((out / ".ditango" / "reports" / "task-0.json").read_text())
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
    assert len(json.loads((out / ".ditango" / "jobs.json").read_text())) == 2  # the failed submission and the retry
    (sidecar,) = [p for p in out.glob("*.json") if p.name not in ("jobs.json", "report.json") and "task" not in p.name]
    assert json.loads(sidecar.read_text())["status"] == "done"
    deadline = time.monotonic() + 60  # accounting may lag the job's end by a few seconds
    while True:
        status = runner.invoke(app, ["status", str(out)])
        if status.exit_code == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    flat = table_text(status.stdout)
    assert status.exit_code == 0 and "FAILED" in flat and "injected fault" in flat, status.stdout


def test_time_limit_requeues_and_finishes_the_batch(runner, tmp_path):
    """2-minute limit, 30 items of 90 steps (3.5 to 6.5 s each on CI machines: 105 s or more of work,
    past the first job's window even when the signal comes late): Slurm signals 30 s before the
    limit (up to a minute earlier), submitit checkpoints (requeues the same call) and the requeued
    job takes what is left from the batch's queue."""
    prompts = tmp_path / "batch.txt"
    colours = ("red", "green", "blue", "yellow", "white")
    lines = [
        f"a {c} {s} moving {d}" for c in colours for s in ("circle", "square") for d in ("left", "right", "up", "down")
    ]
    prompts.write_text("\n".join(lines[:30]) + "\n")
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
        "--partition",
        "debug",
        "--executor",
        "slurm",
        "--time",
        "2",
        "--steps",
        "90",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 30
    # The requeued attempt went on with the batch's queue: each attempt of the job is a worker
    # (a process of its own), both made items, and no item was made twice.
    report = json.loads((out / "report.json").read_text())
    workers = [w for w in report["queue"]["workers"] if w["done"]]
    assert len(workers) >= 2 and {w["launch"] for w in workers} == {workers[0]["launch"]}, workers
    assert sum(w["done"] for w in workers) == 30 and report["counts"]["done"] == 30


def _text(path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


GPU_ARGS = [
    "--steps",
    "3",
    "--height",
    "32",
    "--width",
    "64",
    "--frames",
    "5",
    "--quiet",
    "--partition",
    "debug",
    "--executor",
    "slurm",
    "--nodes",
    "2",
    "--gpus",
    "2",
]  # fmt: skip  (no --device: auto)


def _scontrol_job(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout


def test_gpu_request_of_device_auto_is_recorded_by_slurm(runner, tmp_path, monkeypatch):
    """`--device auto` on a submission asks for a GPU per task, built by the code a GPU cluster
    gets; the nodes advertise gres/gpu:2 without real GPUs, so the ranks compute on CPUs through
    the documented DITANGO_RANK_DEVICE=cpu. The dry run prints the very script submitted."""
    monkeypatch.setenv("DITANGO_RANK_DEVICE", "cpu")  # sbatch exports the environment to the job
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a green circle moving up", "--out", str(out), *GPU_ARGS]
    dry = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.stderr
    planned = json.loads(dry.stdout)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    (submission,) = json.loads((out / ".ditango" / "jobs.json").read_text())
    (job_id,) = submission["job_ids"]
    shown = _scontrol_job(job_id)
    assert "TresPerNode=gres:gpu:2" in shown or "TresPerNode=gres/gpu:2" in shown, shown
    acct = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "ReqTRES"], capture_output=True, text=True, timeout=30
    ).stdout
    assert "gres/gpu=4" in acct, acct  # 2 nodes x 2
    submitted = (Path(submission["folder"]) / job_id / f"{job_id}_submission.sh").read_text()
    assert submitted == planned["sbatch_script"].replace(planned["folder"], submission["folder"])
    report = json.loads((out / "report.json").read_text())
    assert report["device"] == "cpu" and report["counts"]["done"] == 1


def test_a_gres_allocation_is_seen_with_its_gpus():
    """salloc --gres=gpu:2 sets no GPU variable in its shell: the count comes from the job record."""
    probe = "from slurm.launchers.srun import allocation_gpus_per_node as g; print('gpus', g())"
    shown = subprocess.run(
        [
            "salloc",
            "--nodes",
            "1",
            "--gres",
            "gpu:2",
            "--partition",
            "debug",
            "--time",
            "2",
            sys.executable,
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert shown.returncode == 0, shown.stderr
    assert "gpus 2" in shown.stdout, shown.stdout


def test_a_gpu_job_with_a_cpu_only_torch_is_refused_before_it_queues(runner, tmp_path, monkeypatch):
    """Never a silent CPU run, and never a job that fails on the node after its wait in the
    queue: the job would ask for GPUs and run this environment's CPU-only torch, so the
    submission is refused in one line naming the install command; nothing is queued."""
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("this environment has a CUDA build of torch")
    monkeypatch.delenv("DITANGO_RANK_DEVICE", raising=False)
    out = tmp_path / "out"
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
    result = runner.invoke(app, ["generate", "--prompt", "a red ball", "--out", str(out), *GPU_ARGS])
    assert result.exit_code == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "CPU-only build" in line and "setup.sh --cuda" in line, line
    assert not (out / ".ditango" / "jobs.json").exists()
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
    assert set(after.split()) <= set(before.split())


def _sacct_end(job_id: str) -> str:
    """The job's End by accounting, which may say 'Unknown' for a few seconds after the end."""
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "End"], capture_output=True, text=True, timeout=30
        ).stdout.split()
        if (out and out[0][:1].isdigit()) or time.monotonic() > deadline:
            return out[0] if out else ""
        time.sleep(1)


SLURM_STEP_TIMEOUT_S = 15
SLURM_JOB_END_MARGIN_S = 15  # the peer's exit, srun killing the rest (KillWait 5 s), the job's end
SLURM_NOTICE_MARGIN_S = 35  # sacct polled every 10 s, up to 15 s for a killed task's missing result


@pytest.mark.parametrize("kind", ["raise", "hang"])
def test_a_failing_rank_ends_the_job_within_the_step_timeout(runner, tmp_path, monkeypatch, kind):
    """A rank that raises or stops answering ends the job (not only its own task) within the step
    timeout plus a margin, by Slurm's accounting: the peer times out, exits non-zero, and srun's
    --kill-on-bad-exit ends the silent rank, which would otherwise keep the job until its time
    limit (an hour here)."""
    fired = tmp_path / "fired"
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "1:2")
    monkeypatch.setenv("DITANGO_FAULT_KIND", kind)
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(fired))
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--gpus",
        "2",
        "--retries",
        "0",
        "--timeout",
        str(SLURM_STEP_TIMEOUT_S),
        *SMALL,
        "--steps",
        "6",
    ]
    result = runner.invoke(app, args)
    returned = time.time() - fired.stat().st_mtime
    assert result.exit_code == 1, result.stderr
    (job_id,) = json.loads((out / ".ditango" / "jobs.json").read_text())[0]["job_ids"]
    end = _sacct_end(job_id)
    ended = datetime.fromisoformat(end).timestamp() - fired.stat().st_mtime  # sacct: local time, 1 s resolution
    assert ended <= SLURM_STEP_TIMEOUT_S + SLURM_JOB_END_MARGIN_S, ended
    # ... and the waiting command learns of it (sacct polling, reading the tasks' results) soon after.
    assert returned <= ended + SLURM_NOTICE_MARGIN_S, (returned, ended)
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["status"] == "failed"
    if kind == "raise":
        assert "injected fault on rank 1 after step 2" in item["error"]
    else:
        assert "Timed out" in item["error"]


def table_text(text: str) -> str:
    """A rich table's text with its borders gone and wrapped cells rejoined into one line."""
    return " ".join(re.sub(r"[│┃┏┓┗┛━─┡┩╇┳┻└┘┴┬├┤┼╀╁]", " ", text).split())
