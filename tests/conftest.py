"""Shared fixtures (a tiny random Wan, different from tiny-wan, on disk and in memory) and the
test tiers: `slow`, `distributed` (several ranks as local processes) and `slurm` (a real local
Slurm: `bash scripts/local-slurm.sh start`; skipped without one, except in CI)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from tiny_wan import TinyWanConfig, build_tiny_wan

# Deliberately unlike tiny-wan (other seed, heads, head dim, depth, text width) so parity
# tests do not only pass for the built-in configuration.
PARITY_CONFIG = TinyWanConfig(
    seed=11, heads=2, head_dim=12, layers=3, ffn_dim=40, text_dim=24, text_heads=2, latents_stats=(0.3, 1.6, 0.05)
)


# A generate run of the built-in model that takes seconds: three steps of a 64x32, 5-frame video.
FAST_ARGV = ["--steps", "3", "--height", "32", "--width", "64", "--frames", "5", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="session")
def parity_components() -> dict:
    return build_tiny_wan(PARITY_CONFIG)


@pytest.fixture(scope="session")
def saved_model_dir(tmp_path_factory, parity_components):
    """The parity model written as a diffusers-format directory of safetensors."""
    from diffusers import WanPipeline

    path = tmp_path_factory.mktemp("models") / "tiny-random-wan"
    WanPipeline(**parity_components).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def refused(result, *needles: str) -> str:
    """The one `error:` line of a command refused with exit 2 (no traceback), holding `needles`."""
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def cluster_up() -> bool:
    """Whether a local Slurm answers with an idle node."""
    if shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # a controller that does not answer: no cluster
        return False
    return out.returncode == 0 and "idle" in out.stdout


@pytest.hookimpl(trylast=True)  # after `-m` deselected: a tier without Slurm tests never asks Slurm
def pytest_collection_modifyitems(config, items):
    """Tests marked `slurm` skip without a local Slurm, except in CI (where .ci/run starts one:
    there a missing cluster is a failure, not a skip)."""
    wanted = [item for item in items if "slurm" in item.keywords]
    if not wanted or os.environ.get("CI") or cluster_up():
        return
    skip = pytest.mark.skip(reason="no local Slurm (bash scripts/local-slurm.sh start)")
    for item in wanted:
        item.add_marker(skip)
