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
    venv = {"DITANGO_VENV": str(tmp_path / "venv")}  # not this checkout's .venv, which remembers its build
    return subprocess.run(
        ["bash", str(SETUP), "--which", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, "PATH": path, **venv, **(env or {})},
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


def fake_venv(tmp_path: Path, torch_says: str | None) -> Path:
    """A venv whose python answers the build check with `torch_says` (None: torch does not import)
    and logs every other call (a pip install) instead of running it, failing it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    answer = "exit 1" if torch_says is None else f"echo {torch_says}; exit 0"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then {answer}; fi\necho "$@" >> {venv}/calls\nexit 1\n')
    python.chmod(0o755)
    (venv / "bin" / "ditango").write_text("#!/bin/sh\n")
    (venv / "bin" / "ditango").chmod(0o755)
    return venv


def set_up(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DITANGO_TORCH_BUILD", "DITANGO_TORCH_INDEX")}
    return subprocess.run(
        ["bash", str(SETUP), *args], capture_output=True, text=True, timeout=60, env={**env, "DITANGO_VENV": str(venv)}
    )


def test_a_set_up_environment_keeps_its_build_where_the_cluster_advertises_gpus(tmp_path):
    """The issue's trap: set up with the CPU wheel, then scripts/test.sh (which runs set-up again)
    on a machine whose Slurm advertises GPUs swapped it for a CUDA build. The build is remembered;
    a flag still changes it; an environment set up before builds were remembered keeps its own."""
    gpus = {"sinfo": "gpu:h100:8(S:0-1)"}
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".ditango-build").write_text("cpu\n")
    kept = which(tmp_path, gpus)
    assert kept.stdout.startswith("cpu (the build") and "--cpu or --cuda to change it" in kept.stdout, kept.stdout
    assert which(tmp_path, gpus, "--cuda").stdout.split()[0] == "cuda"
    older = fake_venv(tmp_path / "older", "cpu")
    (older / ".ditango-setup").write_text("an earlier set-up\n")
    shown = which(tmp_path, gpus, env={"DITANGO_VENV": str(older)})
    assert shown.stdout.startswith("cpu (the build") and f"{older} has" in shown.stdout, shown.stdout


@pytest.mark.parametrize("torch_says", ["cpu", "cuda", None])
def test_the_done_marker_is_trusted_only_when_torch_imports_as_the_build(tmp_path, torch_says):
    """The marker of a finished set-up (the inputs' hash) skips the install only when torch imports
    and is the build chosen: an install cut short (torch uninstalled, the marker left) installs
    again, and its marker goes until it finishes."""
    venv = fake_venv(tmp_path, torch_says)
    inputs = 'cat pyproject.toml constraints/cpu.txt <(echo "cpu https://download.pytorch.org/whl/cpu")'
    hashed = subprocess.run(
        ["bash", "-c", f"{inputs} | sha256sum"], capture_output=True, text=True, cwd=SETUP.parent.parent, check=True
    )
    want = hashed.stdout.split()[0]  # the marker setup.sh writes for --cpu from the CPU index
    (venv / ".ditango-setup").write_text(want + "\n")
    done = set_up(venv, "--cpu")
    if torch_says == "cpu":
        assert done.returncode == 0 and not (venv / "calls").exists(), done.stderr
        return
    assert done.returncode != 0 and "-m pip" in (venv / "calls").read_text()  # it installs (here: fails to)
    assert not (venv / ".ditango-setup").exists()  # and a failed install leaves no marker
