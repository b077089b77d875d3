"""scripts/setup.sh picks the torch build where the videos will be made (`--which` says which,
installing nothing): CUDA with an NVIDIA driver here or on a Slurm cluster whose nodes advertise
GPUs (a login node has none of its own), the CPU wheel elsewhere; flags and CI force one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"


def which(tmp_path: Path, tools: dict[str, str], *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """setup.sh --which with only `tools` (name: what it prints) on PATH besides the basics."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, output in tools.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\n")
        tool.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "DITANGO_TORCH_BUILD"}
    path = f"{bin_dir}:/usr/bin:/bin"
    return subprocess.run(
        ["bash", str(SETUP), "--which", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, "PATH": path, **(env or {})},
    )


@pytest.mark.parametrize(
    ("tools", "build"),
    [
        ({"nvidia-smi": "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"}, "cuda"),
        ({"sinfo": "gpu:h100:8(S:0-1)"}, "cuda"),  # a login node of a GPU cluster
        ({"sinfo": "(null)"}, "cpu"),  # a Slurm cluster without GPUs
        ({"nvidia-smi": "No devices were found"}, "cpu"),  # a driver, no GPU
        ({}, "cpu"),
    ],
)
def test_the_build_follows_the_machine(tmp_path, tools, build):
    if any(Path(d, "nvidia-smi").exists() for d in ("/usr/bin", "/bin")) and "nvidia-smi" not in tools:
        pytest.skip("this machine has its own nvidia-smi")
    if any(Path(d, "sinfo").exists() for d in ("/usr/bin", "/bin")) and "sinfo" not in tools:
        tools = {**tools, "sinfo": "(null)"}  # this machine's own Slurm (CI's advertises GPUs): not asked
    shown = which(tmp_path, tools)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split()[0] == build, shown.stdout


def test_flags_and_the_environment_force_a_build(tmp_path):
    gpu = {"nvidia-smi": "GPU 0: NVIDIA H200"}
    assert which(tmp_path, gpu, "--cpu").stdout.split()[0] == "cpu"
    assert which(tmp_path, gpu, env={"DITANGO_TORCH_BUILD": "cpu"}).stdout.split()[0] == "cpu"  # what CI sets
    assert which(tmp_path, {}, "--cuda").stdout.split()[0] == "cuda"
    bad = which(tmp_path, {}, "--gpu")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: setup.sh takes --cpu or --cuda, got --gpu"


def test_the_cpu_wheel_comes_from_the_cpu_index_unless_told(tmp_path):
    """PyPI's Linux torch is a CUDA build (GBs of CUDA libraries): the CPU path asks PyTorch's
    CPU index too, whose +cpu wheel outranks it; CI (a wheel on local disk) turns that off."""
    env = {k: v for k, v in os.environ.items() if k != "DITANGO_TORCH_INDEX"}
    shown = subprocess.run(
        ["bash", str(SETUP), "--which", "--cpu"], capture_output=True, text=True, timeout=60, env=env
    )
    assert shown.stdout.strip().endswith("torch from https://download.pytorch.org/whl/cpu"), shown.stdout
    assert (
        which(tmp_path, {}, "--cpu", env={"DITANGO_TORCH_INDEX": ""})
        .stdout.strip()
        .endswith("torch from the indexes pip is set to")
    )
    assert (
        which(tmp_path, {}, "--cuda", env={"DITANGO_TORCH_INDEX": ""})
        .stdout.strip()
        .endswith("torch from the indexes pip is set to")
    )
    cu126 = "https://download.pytorch.org/whl/cu126"
    assert which(tmp_path, {}, "--cuda", env={"DITANGO_TORCH_INDEX": cu126}).stdout.strip().endswith(cu126)
