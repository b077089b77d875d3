"""A run whose ranks compute on GPUs with a CPU-only torch is refused before anything queues
(the jobs run this very environment); a dry run says the same as a warning."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ditango_cli.app import app
from slurm import rank as rank_mod

from .conftest import FAST_ARGV

SMALL = [a for a in FAST_ARGV if a not in ("--device", "cpu", "--quiet")]


@pytest.fixture
def login_node(monkeypatch, tmp_path):
    """A Slurm login node (a fake sbatch that records being called), outside any allocation,
    with this environment's torch made a CPU-only build."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "sbatch-called"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {called}\necho 'Submitted batch job 1'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    return called


def test_a_gpu_submission_with_a_cpu_only_torch_exits_2_before_it_queues(runner, login_node, tmp_path):
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red ball", "--out", str(out), "--nodes", "2", "--gpus", "2", *SMALL]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: this run computes on GPUs, but this environment's torch")
    assert "CPU-only build" in line and "./scripts/setup.sh --cuda" in line and "--device cpu" in line
    assert not login_node.exists() and not (out / ".ditango").exists()  # sbatch never ran
    # The same with --device cpu is a CPU job: no GPU asked for, nothing refused.
    dry = runner.invoke(app, [*args, "--device", "cpu", "--dry-run", "--json"])
    assert dry.exit_code == 0 and "CPU-only" not in dry.stderr


def test_a_dry_run_warns_of_it_and_shows_the_script(runner, login_node, tmp_path):
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red ball", "--out", str(out), "--nodes", "2", "--gpus", "2", *SMALL]
    dry = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.stderr
    warning = [ln for ln in dry.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "CPU-only build" in warning[0] and "setup.sh --cuda" in warning[0]
    script = json.loads(dry.stdout)["sbatch_script"].splitlines()
    assert "#SBATCH --gpus-per-node=2" in script
    assert any(ln.startswith("#SBATCH --cpus-per-task=") for ln in script)  # host resources: asked for too
    assert any(ln.startswith("#SBATCH --mem=") and ln.endswith("G") for ln in script)
    assert not login_node.exists()


def test_the_documented_cpu_rank_setting_is_not_refused(runner, login_node, tmp_path, monkeypatch):
    """DITANGO_RANK_DEVICE=cpu: the job asks Slurm for GPUs but its ranks compute on CPUs (a
    cluster of placeholder GPUs, as the Slurm tests have), so the CPU build is what they need."""
    monkeypatch.setenv(rank_mod.RANK_DEVICE_ENV, "cpu")
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(tmp_path / "out"),
        "--nodes",
        "2",
        "--gpus",
        "2",
        *SMALL,
        "--dry-run",
        "--json",
    ]
    dry = runner.invoke(app, args)
    assert dry.exit_code == 0 and "CPU-only" not in dry.stderr, dry.stderr
