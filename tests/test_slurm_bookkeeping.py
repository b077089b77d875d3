"""Slurm bookkeeping of an output folder: refused submissions, OUT/.ditango/jobs.json, and what
`ditango status` / `ditango cancel` hand to Slurm's commands.

Tests marked `real_slurm` run against the local cluster (`bash scripts/local-slurm.sh start`)
and skip without it, except in CI; the others put fake Slurm commands first on PATH, which
record their arguments, so they also prove what never reaches a Slurm command."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ditango_cli.app import app
from runtime.config import Item, RunConfig
from runtime.outputs import state_dir
from slurm.jobs import ended_state, jobs_file, live_jobs
from slurm.launchers.sbatch import submit
from slurm.options import SlurmOptions
from tests.conftest import FAST_ARGV

real_slurm = pytest.mark.slurm
SMALL = FAST_ARGV
NEVER_A_JOB = "99999999"  # above Slurm's default MaxJobId (67043328): no job ever has this id
SLURM_COMMANDS = ("sbatch", "scancel", "squeue", "sacct", "srun")


def fake_slurm(tmp_path: Path, monkeypatch, **answers: tuple[str, str, int]) -> Path:
    """Fake Slurm commands first on PATH. Each appends [name, *args] as one JSON line to the
    returned file and answers as `answers[name]` says: (stdout, stderr, exit status); by
    default nothing, exit 0."""
    bin_dir, calls = tmp_path / "fake-slurm", tmp_path / "slurm-calls.jsonl"
    bin_dir.mkdir()
    for name in SLURM_COMMANDS:
        out, err, code = answers.get(name, ("", "", 0))
        script = bin_dir / name
        script.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"with open({str(calls)!r}, 'a') as f:\n    f.write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
            f"sys.stdout.write({out!r}); sys.stderr.write({err!r}); sys.exit({code})\n"
        )
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def recorded(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def output_folder(tmp_path: Path, record) -> Path:
    """An output folder of ditango whose jobs.json holds `record` (bytes: written as they are)."""
    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    data = record if isinstance(record, bytes) else json.dumps(record).encode()
    jobs_file(out).write_bytes(data)
    return out


def submission(*job_ids: str, tasks: int = 1) -> dict:
    return {"submitted_at": "20260101T000000000000", "folder": "/nowhere", "job_ids": list(job_ids), "tasks": tasks}


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (result.exit_code, lines)
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def jobs():
    """Real jobs a test submits (`sbatch --wrap`); whatever is left of them is cancelled after."""
    submitted: list[str] = []

    def sbatch(command: str, *args: str) -> str:
        run = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--partition=debug",
                "--time=5",
                "--job-name=bookkeeping-test",
                "--output=/dev/null",
                *args,
                f"--wrap={command}",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert run.returncode == 0, run.stderr
        job_id = run.stdout.strip().split(";")[0]
        submitted.append(job_id)
        return job_id

    yield sbatch
    if submitted:
        subprocess.run(["scancel", *submitted], capture_output=True, timeout=30)


def wait_until(predicate, timeout_s: float = 60.0, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return value


# --- submissions Slurm refuses ----------------------------------------------------------


@real_slurm
def test_a_refused_submission_is_one_line_and_leaves_no_submission_folder(runner, tmp_path):
    """Bug: a bad partition gave a raw CalledProcessError/FailedJobError traceback and left
    OUT/slurm/<stamp>/code behind."""
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red ball", "--out", str(out), *SMALL, "--executor", "slurm"]
    result = runner.invoke(app, [*args, "--partition", "nosuch"])
    assert one_error_line(result) == "error: sbatch refused the job: sbatch: error: invalid partition specified: nosuch"
    assert not (out / "slurm").exists()
    assert not jobs_file(out).exists()


@real_slurm
def test_a_step_srun_refuses_is_one_line_and_leaves_no_steps_folder(runner, tmp_path, monkeypatch):
    """Bug: inside an allocation, a step srun would not start (more nodes than allocated) was
    taken for a failed item; it is a configuration error with srun's own message."""
    run = subprocess.run(
        ["salloc", "--no-shell", "--nodes=1", "--partition=debug", "--time=5", "--job-name=bookkeeping-test"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    allocation = run.stderr.split("Granted job allocation")[-1].split()[0]
    assert allocation.isdigit(), run.stderr
    try:
        monkeypatch.setenv("SLURM_JOB_ID", allocation)
        out = tmp_path / "out"
        args = ["generate", "--prompt", "a red ball", "--out", str(out), *SMALL, "--nodes", "2", "--gpus", "2"]
        args += ["--parallel", "ring"]  # a layout given: no search, whose plan line would come first
        result = runner.invoke(app, [*args, "--executor", "slurm"])
    finally:
        subprocess.run(["scancel", allocation], capture_output=True, timeout=30)
    assert one_error_line(result) == "error: srun refused the step: srun: error: Only allocated 1 nodes asked for 2"
    assert not (out / "slurm").exists()


# --- a damaged jobs.json ----------------------------------------------------------------

DAMAGED = {
    "not JSON": (b'[{"submitted_at": "x", ', "damaged job record (not valid JSON ("),
    "not UTF-8": (b'\xff\xfe[{"job_ids": []}]', "damaged job record (not UTF-8 text"),
    "not a list": (json.dumps(submission("123")).encode(), "expected a list of submissions, got dict"),
    "no folder": (json.dumps([{**submission("123"), "folder": None}]).encode(), "folder is None, not a string"),
    "ids not a list": (json.dumps([{**submission(), "job_ids": "123"}]).encode(), "job_ids is '123', not a list"),
    "tasks 0": (json.dumps([submission("123", tasks=0)]).encode(), "tasks is 0, not an integer from 1 to 65536"),
    "an option as job id": (
        json.dumps([submission("123"), submission("--version")]).encode(),
        "submission 2: '--version' is not a Slurm job id",
    ),
    "id with a newline": (json.dumps([submission("123\n456")]).encode(), "'123\\n456' is not a Slurm job id"),
}


@pytest.mark.parametrize("command", ["status", "cancel"])
@pytest.mark.parametrize("variant", list(DAMAGED))
def test_a_damaged_job_record_is_one_line_and_reaches_no_slurm_command(runner, tmp_path, monkeypatch, command, variant):
    """Bug: a malformed jobs.json crashed `status`/`cancel` with a traceback, and its job ids
    went to scancel unchecked: "--version" acted as an option."""
    calls = fake_slurm(tmp_path, monkeypatch, squeue=("123|RUNNING\n", "", 0))
    data, said = DAMAGED[variant]
    out = output_folder(tmp_path, data)
    line = one_error_line(runner.invoke(app, [command, str(out)]))
    assert line.startswith(f"error: {jobs_file(out)}: ") and said in line, line
    assert recorded(calls) == []


def test_a_job_record_that_cannot_be_read_is_one_line(runner, tmp_path, monkeypatch):
    calls = fake_slurm(tmp_path, monkeypatch)
    out = tmp_path / "out"
    jobs_file(out).mkdir(parents=True)  # a folder where the file should be
    line = one_error_line(runner.invoke(app, ["cancel", str(out)]))
    assert line == f"error: job record {jobs_file(out)} is a folder, not a regular file", line
    assert recorded(calls) == []


def _config(out: Path) -> RunConfig:
    item = Item(
        id="a-red-ball",
        prompt="a red ball",
        negative_prompt="",
        seed=0,
        height=32,
        width=64,
        frames=5,
        steps=3,
        guidance=5.0,
    )
    return RunConfig(model="tiny-wan", model_path=None, items=(item,), out_dir=out, device="cpu")


def test_submit_refuses_a_damaged_job_record_rather_than_overwrite_it(tmp_path, monkeypatch):
    """submit appends to jobs.json: a damaged one is refused before anything reaches sbatch,
    and is left as it was."""
    calls = fake_slurm(tmp_path, monkeypatch, sbatch=("Submitted batch job 123\n", "", 0))
    damaged = b'[{"submitted_at": "20260101T000000000000", "folder": "/x", "job_ids": ["1"], "tas'
    out = output_folder(tmp_path, damaged)
    with pytest.raises(Exception) as raised:
        submit(_config(out), SlurmOptions(partition="debug"))
    assert type(raised.value).__name__ == "Damaged" and "damaged job record" in str(raised.value)
    assert jobs_file(out).read_bytes() == damaged
    assert recorded(calls) == [] and not (out / "slurm").exists()


def test_submit_records_the_job_in_the_bookkeeping_folder(tmp_path, monkeypatch):
    """jobs.json lives in OUT/.ditango/ (created if needed), appended to, written atomically."""
    calls = fake_slurm(tmp_path, monkeypatch, sbatch=("Submitted batch job 4242\n", "", 0))
    out = tmp_path / "out"
    out.mkdir()
    submit(_config(out), SlurmOptions(partition="debug"))
    submit(_config(out), SlurmOptions(partition="debug"))
    record = json.loads(jobs_file(out).read_text())
    assert [s["job_ids"] for s in record] == [["4242"], ["4242"]] and record[0]["tasks"] == 1
    assert [c[0] for c in recorded(calls)] == ["sbatch", "sbatch"]
    assert not (out / "jobs.json").exists() and [p.name for p in state_dir(out).iterdir()] == ["jobs.json"]


# --- folders that are not output folders ------------------------------------------------


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_status_and_cancel_refuse_a_folder_that_is_not_an_output_folder(runner, tmp_path, monkeypatch, command):
    """Bug: `cancel` acted on any folder with a jobs.json (here one in the old place, OUT/),
    cancelling the jobs it named."""
    calls = fake_slurm(tmp_path, monkeypatch, squeue=("123|RUNNING\n", "", 0))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "jobs.json").write_text(json.dumps([submission("123")]))
    line = one_error_line(runner.invoke(app, [command, str(foreign)]))
    assert line == f"error: {foreign} is not an output folder of ditango (it has no .ditango/); nothing was done"
    missing = one_error_line(runner.invoke(app, [command, str(tmp_path / "missing")]))
    assert missing == f"error: {tmp_path / 'missing'} is not a directory"
    assert recorded(calls) == []


def test_an_output_folder_with_nothing_submitted_is_one_line(runner, tmp_path, monkeypatch):
    calls = fake_slurm(tmp_path, monkeypatch)
    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    line = one_error_line(runner.invoke(app, ["cancel", str(out)]))
    assert line == f"error: {out}: no Slurm job was submitted from this folder (no .ditango/jobs.json)"
    assert recorded(calls) == [] and live_jobs(out) == []


# --- failing Slurm commands -------------------------------------------------------------

NO_CONTROLLER = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
UNKNOWN_IDS = "slurm_load_jobs error: Invalid job id specified\n"


def test_a_failing_squeue_is_one_line(runner, tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, squeue=("", NO_CONTROLLER, 1))
    out = output_folder(tmp_path, [submission("123")])
    for command in ("status", "cancel"):
        line = one_error_line(runner.invoke(app, [command, str(out)]))
        assert line == f"error: squeue failed: {NO_CONTROLLER.strip()}"
    with pytest.raises(Exception, match="squeue failed: slurm_load_jobs error: Unable to contact"):
        live_jobs(out)


def test_a_failing_sacct_is_one_line_and_cancels_nothing(runner, tmp_path, monkeypatch):
    """Bug: status swallowed sacct's failure (submitit logs it) and showed UNKNOWN, exit 0."""
    disabled = "sacct: error: Slurm accounting storage is disabled\n"
    calls = fake_slurm(tmp_path, monkeypatch, squeue=("123|RUNNING\n", "", 0), sacct=("", disabled, 1))
    out = output_folder(tmp_path, [submission("123", "456")])  # 456: not known to the controller
    for command in ("status", "cancel"):
        assert one_error_line(runner.invoke(app, [command, str(out)])) == f"error: sacct failed: {disabled.strip()}"
    assert "scancel" not in [c[0] for c in recorded(calls)]


def test_a_failing_scancel_is_one_line(runner, tmp_path, monkeypatch):
    denied = "scancel: error: Kill job error on job id 123_4: Access/permission denied\n"
    calls = fake_slurm(tmp_path, monkeypatch, squeue=("123_4|RUNNING\n", "", 0), scancel=("", denied, 1))
    out = output_folder(tmp_path, [submission("123_4")])
    assert one_error_line(runner.invoke(app, ["cancel", str(out)])) == f"error: scancel failed: {denied.strip()}"
    # Job ids go to squeue as the value of --jobs=, and to scancel only once checked.
    assert recorded(calls)[0][-1] == "--jobs=123_4" and recorded(calls)[-1] == ["scancel", "123_4"]


# --- cancel says per job what happened --------------------------------------------------


@real_slurm
def test_cancel_says_per_job_what_happened(runner, tmp_path, jobs):
    """Bug: `cancel` said "cancelled <id>" for every recorded id, also for jobs that had ended
    or never existed (scancel says nothing and exits 0 for those)."""
    ended = jobs("true", "--wait")  # returns once the job has ended
    live = jobs("sleep 300")
    out = output_folder(tmp_path, [submission(ended), submission(live, NEVER_A_JOB)])
    result = runner.invoke(app, ["cancel", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"job {ended}: already ended (COMPLETED)"
    assert lines[1] in (f"job {live}: cancelled (was PENDING)", f"job {live}: cancelled (was RUNNING)"), lines
    assert lines[2:] == [f"job {NEVER_A_JOB}: unknown to Slurm"]
    assert live_jobs(out) == []  # cancel waited for the end: a rerun can own OUT at once


@real_slurm
def test_cancel_with_nothing_live_says_so_and_exits_1(runner, tmp_path, jobs):
    ended = jobs("true", "--wait")
    out = output_folder(tmp_path, [submission(ended, NEVER_A_JOB)])
    result = runner.invoke(app, ["cancel", str(out)])
    assert result.exit_code == 1, result.output
    assert result.stdout.strip().splitlines() == [
        f"job {ended}: already ended (COMPLETED)",
        f"job {NEVER_A_JOB}: unknown to Slurm",
    ]
    status = runner.invoke(app, ["status", str(out)])
    assert status.exit_code == 0 and "COMPLETED" in status.stdout and "UNKNOWN" in status.stdout, status.output


@real_slurm
def test_status_of_a_failed_job_whose_logs_are_gone(runner, tmp_path, monkeypatch, jobs):
    """Bug: `status` crashed (FileNotFoundError in submitit) on a failed job whose submission
    folder had been removed."""
    monkeypatch.setenv("COLUMNS", "200")  # the table's rows on one line each
    cancelled = jobs("sleep 300")
    subprocess.run(["scancel", cancelled], check=True, timeout=30)
    out = output_folder(tmp_path, [submission(cancelled)])  # its folder: /nowhere
    assert wait_until(lambda: live_jobs(out) == [])
    status = runner.invoke(app, ["status", str(out)])
    assert status.exit_code == 1 and "CANCELLED" in status.stdout, status.output
    assert "its logs are gone: no /nowhere" in status.stdout and "Traceback" not in status.output


# --- live_jobs --------------------------------------------------------------------------


@real_slurm
def test_live_jobs_follows_real_jobs_until_they_end(tmp_path, jobs):
    """Live while pending or running (here an array of two sleeping tasks, recorded as submitit
    records them, "<id>_<task>"), [] once cancelled; [] once a job completed."""
    array = jobs("sleep 300", "--array=0-1")
    out = output_folder(tmp_path, [submission(f"{array}_0", f"{array}_1")])
    live = live_jobs(out)
    assert [job for job, _ in live] == [f"{array}_0", f"{array}_1"]
    assert all(state in ("PENDING", "RUNNING", "CONFIGURING") for _, state in live), live
    subprocess.run(["scancel", array], check=True, timeout=30)
    assert wait_until(lambda: live_jobs(out) == [])
    done = jobs("true", "--wait")
    (state_dir(out) / "jobs.json").write_text(json.dumps([submission(done)]))
    assert live_jobs(out) == []


def test_live_jobs_is_empty_without_a_record_or_without_slurm(tmp_path, monkeypatch):
    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    assert live_jobs(out) == []  # nothing submitted
    jobs_file(out).write_text(json.dumps([submission("123")]))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no Slurm command at all: nothing can be live here
    assert live_jobs(out) == []


def test_live_jobs_keeps_jobs_that_have_not_ended(tmp_path, monkeypatch):
    """One squeue call; every state but Slurm's final ones counts as live."""
    answer = "1|PENDING\n2|RUNNING\n3|COMPLETED\n4|CANCELLED\n5|SUSPENDED\n6|REQUEUED\n7|COMPLETING\n8|TIMEOUT\n"
    calls = fake_slurm(tmp_path, monkeypatch, squeue=(answer, "", 0))
    out = output_folder(tmp_path, [submission(*"12345678"), submission("9")])
    assert live_jobs(out) == [
        ("1", "PENDING"),
        ("2", "RUNNING"),
        ("5", "SUSPENDED"),
        ("6", "REQUEUED"),
        ("7", "COMPLETING"),
    ]
    assert [c[0] for c in recorded(calls)] == ["squeue"]
    assert ended_state("CANCELLED by 0") and not ended_state("PREEMPTED") and not ended_state("CONFIGURING")


def test_live_jobs_with_ids_unknown_to_the_controller_is_empty(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, squeue=("", UNKNOWN_IDS, 1))
    assert live_jobs(output_folder(tmp_path, [submission("123")])) == []


@real_slurm
def test_steps_start_beside_a_step_that_holds_the_allocation(tmp_path):
    """Bug: from an `srun --pty bash` shell, whose step holds every CPU (and GPU) of the
    allocation, the ranks' step was created without --overlap and waited for them for ever.
    Here a `sleep` step holds both CPUs of a one-node allocation while the command runs."""
    out = tmp_path / "out"
    cli = shlex.join(
        [
            sys.executable,
            "-c",
            "from ditango_cli.app import main; main()",
            "generate",
            "--prompt",
            "a red ball",
            "--out",
            str(out),
            *SMALL,
            "--gpus",
            "2",
            "--executor",
            "slurm",
            "--timeout",
            "10",
            "--setup-timeout",
            "30",
        ]
    )
    script = f"srun --ntasks 2 sleep 300 & sleep 3; {cli}; code=$?; kill %1; exit $code"
    run = subprocess.run(
        [
            "salloc",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--partition=debug",
            "--time=5",
            "--job-name=bookkeeping-test",
            "bash",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "report.json").read_text())["counts"]["done"] == 1
