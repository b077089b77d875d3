"""Nothing a user types runs as a command: output folders, run-file values and Slurm options that
hold shell syntax reach the sbatch script quoted, the dry run prints them quoted, and the local
executor takes them literally. Without Slurm: the dry run's script runs under bash with a fake
`srun` that records what it was given. tests/test_slurm_hostile.py submits the same values to
the local Slurm."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ditango_cli.app import app

# Shell syntax of every kind, spaces, quotes and non-ASCII letters; no slash, so it can name a
# folder. Any expansion of it would create a CANARY-* file in the working directory.
HOSTILE = "o $(touch CANARY-1) `touch CANARY-2`; touch CANARY-3 | touch CANARY-4 & 'q' \"d\" é中"
SIZE = ["--steps", "1", "--height", "16", "--width", "16", "--frames", "1", "--device", "cpu"]
TINY = ["--prompt", "a red ball", *SIZE]


def canaries(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("CANARY-*")]


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (result.exit_code, lines)
    assert "Traceback" not in result.output
    return lines[0]


def fake_srun(tmp_path: Path) -> tuple[Path, Path]:
    """A PATH folder whose `srun` records its arguments and PYTHONPATH as one JSON line."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "srun-calls.jsonl"
    bin_dir.mkdir()
    script = bin_dir / "srun"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'pythonpath': os.environ.get('PYTHONPATH'),"
        " 'cwd': os.getcwd()}) + '\\n')\n"
    )
    script.chmod(0o755)
    return bin_dir, calls


@pytest.mark.parametrize("pythonpath", [None, "/already/there"])
def test_the_sbatch_script_takes_a_hostile_output_folder_literally(runner, tmp_path, monkeypatch, pythonpath):
    """Bug: `export PYTHONPATH=<out>/slurm/<stamp>/code:...` was pasted unquoted into the sbatch
    script, so `--out 'runs/o$(touch pwned)'` ran `touch pwned` on the compute node."""
    out = tmp_path / HOSTILE / "runs"
    result = runner.invoke(app, ["generate", *TINY, "--executor", "slurm", "--out", str(out), "--dry-run", "--json"])
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    folder = Path(record["folder"])
    assert folder.parent == out.resolve() / "slurm"
    script = tmp_path / "job.sh"
    script.write_text(record["sbatch_script"], encoding="utf-8")
    bin_dir, calls = fake_srun(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert canaries(tmp_path) == []
    (call,) = [json.loads(line) for line in calls.read_text(encoding="utf-8").splitlines()]
    code = str(folder / "code")
    # No empty entry (a trailing ':' would put the working directory on sys.path).
    assert call["pythonpath"] == (code if pythonpath is None else f"{code}:{pythonpath}")
    assert call["argv"][-1] == str(folder / "%j")
    assert call["argv"][call["argv"].index("--output") + 1] == str(folder / "%j" / "%j_%t_log.out")
    assert "ditango: job attempt starts" in done.stderr


def test_the_dry_run_prints_the_environment_quoted(runner, tmp_path):
    out = tmp_path / HOSTILE
    result = runner.invoke(app, ["generate", *TINY, "--executor", "slurm", "--out", str(out), "--dry-run"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.split("environment of every rank")[1].splitlines()
    pythonpath = next(line.strip() for line in lines if line.strip().startswith("PYTHONPATH="))
    # As a shell reads the line: the literal folder, then the rank's own PYTHONPATH if any.
    words = shlex.split(pythonpath.removesuffix('"${PYTHONPATH:+:$PYTHONPATH}"'))
    assert words == [f"PYTHONPATH={out.resolve()}/slurm/{words[0].split('/slurm/')[1]}"]
    assert words[0].split("/slurm/")[1].endswith("/code")
    trace = next(line.strip() for line in lines if line.strip().startswith("TORCH_FR_DUMP_TEMP_FILE="))
    assert shlex.split(trace) == [f"TORCH_FR_DUMP_TEMP_FILE={out.resolve() / 'logs' / 'nccl-trace-rank-'}"]


@pytest.mark.parametrize("name", ["p%j", "b\\s", "n\nl"])
def test_an_output_folder_slurm_cannot_carry_is_one_line(runner, tmp_path, name):
    """Slurm reads `%` in a log path as a pattern (%j: the job id) and a backslash as turning the
    patterns off, and a newline would end a #SBATCH line: such a job ran, but its logs landed
    elsewhere and it was reported failed ('No output/error stream produced')."""
    out = tmp_path / name
    result = runner.invoke(app, ["generate", *TINY, "--executor", "slurm", "--out", str(out), "--dry-run"])
    line = one_error_line(result)
    assert "Slurm cannot carry" in line and "--executor local" in line
    # The same folder from a run file.
    run_file = tmp_path / "run.toml"
    run_file.write_text(f"out = {json.dumps(str(out))}\n", encoding="utf-8")
    result = runner.invoke(app, ["generate", *TINY, "--executor", "slurm", "--config", str(run_file), "--dry-run"])
    assert "Slurm cannot carry" in one_error_line(result)


@pytest.mark.parametrize("flag", ["--partition", "--account", "--qos", "--constraint", "--mem"])
@pytest.mark.parametrize("value", ["gpu\ntouch CANARY-5", "gpu\\x"])
def test_a_slurm_value_sbatch_cannot_carry_is_one_line(runner, tmp_path, flag, value):
    """A newline would end the #SBATCH line; sbatch's parser takes a backslash as an escape even
    inside quotes, so the job would get another value than the one typed."""
    args = ["generate", *TINY, "--executor", "slurm", "--out", str(tmp_path / "o"), flag, value, "--dry-run"]
    assert "cannot reach sbatch" in one_error_line(runner.invoke(app, args))


def test_the_local_executor_writes_into_a_hostile_folder_from_a_run_file(runner, tmp_path, monkeypatch):
    """A run file's `out` and `prompts` with shell syntax: taken literally, relative to nothing
    but the working directory, and nothing runs."""
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / f"p {HOSTILE}" / "batch.txt"
    prompts.parent.mkdir()
    prompts.write_text("a red ball\n", encoding="utf-8")
    run_file = tmp_path / "run.toml"
    run_file.write_text(f"out = {json.dumps(HOSTILE)}\nprompts = {json.dumps(str(prompts))}\n", encoding="utf-8")
    result = runner.invoke(app, ["generate", *SIZE, "--config", str(run_file), "--executor", "local", "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert len(list((tmp_path / HOSTILE).glob("*.mp4"))) == 1
    assert canaries(tmp_path) == []
