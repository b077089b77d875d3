"""Shared fixtures: a tiny random Wan (different from tiny-wan) on disk and in memory."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tiny_wan import TinyWanConfig, build_tiny_wan

# Deliberately unlike tiny-wan (other seed, heads, head dim, depth, text width) so parity
# tests do not only pass for the built-in configuration.
PARITY_CONFIG = TinyWanConfig(
    seed=11, heads=2, head_dim=12, layers=3, ffn_dim=40, text_dim=24, text_heads=2, latents_stats=(0.3, 1.6, 0.05)
)


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
