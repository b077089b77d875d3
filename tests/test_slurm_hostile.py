"""Hostile and careless values against the real local Slurm (`bash scripts/local-slurm.sh start`;
skipped without it, except in CI): an output folder, a run file's `out`, a prompt file's and a
model's path, and Slurm options that hold `$(...)`, backticks, `;`, `|`, `&`, quotes, spaces and
non-ASCII letters. No canary file may appear; each job either runs with the literal value (its
video in the literal folder) or is refused in one line with exit 2."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import pytest

from ditango_cli.app import app
from slurm.jobs import jobs_file
from tests.test_shell_quoting import HOSTILE, canaries, one_error_line
from tests.test_slurm_bookkeeping import real_slurm

pytestmark = real_slurm
SMALL = ["--steps", "2", "--height", "32", "--width", "64", "--frames", "5", "--device", "cpu", "--quiet",
         "--executor", "slurm", "--nodes", "1", "--gpus-per-node", "1"]  # fmt: skip


def job_ids(out) -> list[str]:
    return [j for sub in json.loads(jobs_file(out).read_text(encoding="utf-8")) for j in sub["job_ids"]]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """The working directory of the command: where an expanded `touch CANARY-*` would land,
    besides the job's own (the code snapshot under the output folder)."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_hostile_paths_and_options_run_literally(runner, tmp_path, work, saved_model_dir):
    model = tmp_path / f"m {HOSTILE}"
    shutil.copytree(saved_model_dir, model)
    prompts = tmp_path / f"p {HOSTILE}" / "batch.txt"
    prompts.parent.mkdir()
    prompts.write_text("a red ball moving left\n", encoding="utf-8")
    out = tmp_path / HOSTILE
    # This Slurm does not enforce accounts or QOS: it takes them, so the job runs.
    args = [
        "generate",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        *SMALL,
        "--account",
        HOSTILE,
        "--qos",
        HOSTILE,
        "--slurm-arg",
        f"comment={HOSTILE}",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.mp4"))) == 1
    (job,) = job_ids(out)
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    assert f"Comment={HOSTILE} " in shown  # sbatch read the quoted #SBATCH value unchanged
    for command in (["status", str(out)], ["report", str(out)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, (command, result.stderr)
    assert "1 done" in result.stdout
    assert canaries(tmp_path) == []


def test_a_run_file_out_with_no_wait_then_status_cancel_and_report(runner, tmp_path, work):
    run_file = work / "run.toml"
    run_file.write_text(f"out = {json.dumps(HOSTILE)}\nprompt = 'a blue ball'\n", encoding="utf-8")
    result = runner.invoke(app, ["generate", "--config", str(run_file), *SMALL, "--no-wait"])
    assert result.exit_code == 0, result.stderr
    out = work / HOSTILE
    (job,) = job_ids(out)
    # The command it suggests is quoted for a shell: pasted, it names the literal folder.
    # (the run file's relative out is relative to its folder: the suggestion names it whole)
    assert shlex.split(result.stdout.split("follow with: ")[1]) == ["ditango", "status", str(work / HOSTILE)]
    assert runner.invoke(app, ["status", str(out)]).exit_code == 0
    result = runner.invoke(app, ["cancel", str(out)])
    assert result.exit_code == 0 and job in result.output, result.output
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code in (0, 1) and "Traceback" not in result.output, result.output
    assert canaries(tmp_path) == []


@pytest.mark.parametrize("flag", ["--partition", "--constraint", "--mem"])
def test_values_slurm_refuses_are_one_line(runner, tmp_path, work, flag):
    """sbatch's own refusal, in one line; --mem's form is checked before sbatch is asked."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--prompt", "a red ball", "--out", str(out), *SMALL, flag, HOSTILE])
    said = "error: --mem " if flag == "--mem" else "error: sbatch refused the job: sbatch: error: "
    assert one_error_line(result).startswith(said)
    assert not (out / "slurm").exists() and not jobs_file(out).exists()
    assert canaries(tmp_path) == []


@pytest.mark.parametrize(
    "where", ["--out", "run-file out", "--partition", "--account", "--qos", "--constraint", "--mem", "--slurm-arg"]
)
def test_a_newline_never_reaches_sbatch(runner, tmp_path, work, where):
    """A newline would end a #SBATCH line and start a shell line of its own: refused in one line
    before anything is submitted (no job, no jobs.json, no submission folder)."""
    value = "gpu\ntouch CANARY-6"
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red ball", *SMALL]
    if where == "--out":
        out = tmp_path / value
        args += ["--out", str(out)]
    elif where == "run-file out":
        out = tmp_path / value
        run_file = work / "run.toml"
        run_file.write_text(f"out = {json.dumps(str(out))}\n", encoding="utf-8")
        args += ["--config", str(run_file)]
    else:
        args += [
            "--out",
            str(out),
            *(["--slurm-arg", f"comment={value}"] if where == "--slurm-arg" else [where, value]),
        ]
    line = one_error_line(runner.invoke(app, args))
    assert "cannot carry" in line or "cannot reach sbatch" in line, line
    assert not out.exists() or not (out / "slurm").exists()
    assert canaries(tmp_path) == []
