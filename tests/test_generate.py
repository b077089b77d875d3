"""End-to-end `ditango generate` on the built-in tiny-wan: outputs, report, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from ditango_cli.app import app
from runtime.video import read_mp4

FAST = ["--steps", "2", "--height", "32", "--width", "48", "--frames", "5", "--device", "cpu"]


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    """One batch of two items (one with a long non-ASCII prompt) shared by several checks."""
    from typer.testing import CliRunner

    root = tmp_path_factory.mktemp("batch")
    prompts = root / "batch.jsonl"
    long_prompt = "ein roter Kreis bewegt sich nach links, " * 20 + "über schwarzem Hintergrund ✓"
    prompts.write_text(
        json.dumps({"id": "clip-a", "prompt": "a red circle moving left", "seed": 3, "frames": 9})
        + "\n"
        + json.dumps({"prompt": long_prompt, "height": 48, "guidance": 1.0})
        + "\n"
    )
    out = root / "out"
    result = CliRunner().invoke(
        app, ["generate", "--prompts", str(prompts), "--out", str(out), "--save-latents", *FAST]
    )
    return result, out, long_prompt


def test_batch_writes_videos_sidecars_latents_and_report(batch_run):
    result, out, long_prompt = batch_run
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == 1
    assert report["model"] == "tiny-wan"
    assert report["layout"] == {
        "world_size": 1,
        "nodes": 1,
        "gpus_per_node": 1,
        "cfg_degree": 1,
        "cp_degree": 1,
        "strategy": "none",
        "ulysses_degree": 1,
        "group_size": 1,
        "ring_degree": 1,
    }
    assert report["attention_backend"] == "sdpa"  # one rank: diffusers' attention on SDPA (auto on the CPU)
    assert report["counts"] == {"done": 2, "skipped": 0, "failed": 0}
    assert report["peak_memory_bytes"] > 0
    assert set(report["versions"]) >= {"torch", "diffusers", "ditango"}

    first, second = report["items"]
    assert first["id"] == "clip-a" and first["seed"] == 3 and first["frames"] == 9
    # Derived id: index + hash, never the prompt text.
    assert second["id"].startswith("0001-") and len(second["id"]) == 13
    assert second["prompt"] == long_prompt and second["height"] == 48 and second["guidance"] == 1.0

    for item, (frames, height, width) in zip(report["items"], [(9, 32, 48), (5, 48, 48)], strict=True):
        assert item["status"] == "done"
        assert item["video"] == f"{item['id']}.mp4"
        video = read_mp4(out / item["video"])
        assert video.shape == (frames, height, width, 3)
        assert video.std() > 0  # not a blank clip
        timing = item["timing"]
        assert len(timing["step_s"]) == item["steps"] == 2
        parts = sum(timing[k] for k in ("text_encode_s", "denoise_s", "decode_s", "write_s"))
        assert timing["total_s"] == pytest.approx(parts, abs=1e-5)
        assert item["comm"] == {"intra_node_bytes": 0, "inter_node_bytes": 0, "by_purpose": {}}
        assert item["attention"] == {"computed_fraction_all_steps": 1.0}
        sidecar = json.loads((out / f"{item['id']}.json").read_text())
        assert sidecar == item
        latents = load_file(out / item["latents"])["latents"]
        assert tuple(latents.shape) == (1, 12, (frames - 1) // 4 + 1, height // 4, width // 4)  # tiny-wan geometry
    assert not list(out.glob("*partial*"))


def test_rerun_skips_finished_items_and_keeps_their_records(batch_run, runner, tmp_path):
    _, out, _ = batch_run
    before = json.loads((out / "report.json").read_text())
    mtime = (out / "clip-a.mp4").stat().st_mtime_ns
    prompts = out.parent / "batch.jsonl"
    result = runner.invoke(app, ["generate", "--prompts", str(prompts), "--out", str(out), "--save-latents", *FAST])
    assert result.exit_code == 0, result.stderr
    assert "skipping clip-a" in result.stderr and "--overwrite" in result.stderr
    assert (out / "clip-a.mp4").stat().st_mtime_ns == mtime
    after = json.loads((out / "report.json").read_text())
    assert after["counts"] == {"done": 0, "skipped": 2, "failed": 0}
    for old, new in zip(before["items"], after["items"], strict=True):
        assert new["status"] == "skipped"
        assert new["timing"] == old["timing"] and new["video"] == old["video"]


def test_overwrite_regenerates_identically(runner, tmp_path):
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a white square moving down",
        "--out",
        str(out),
        "--save-latents",
        "--quiet",
        *FAST,
    ]
    assert runner.invoke(app, args).exit_code == 0
    first = load_file(next(out.glob("*.latents.safetensors")))["latents"]
    mtime = next(out.glob("*.mp4")).stat().st_mtime_ns
    result = runner.invoke(app, [*args, "--overwrite"])
    assert result.exit_code == 0, result.stderr
    assert next(out.glob("*.mp4")).stat().st_mtime_ns != mtime
    second = load_file(next(out.glob("*.latents.safetensors")))["latents"]
    assert np.array_equal(first.numpy(), second.numpy())  # deterministic from the seed


def test_json_flag_prints_report_path(runner, tmp_path):
    out = tmp_path / "o"
    result = runner.invoke(app, ["generate", "--prompt", "a blue ball", "--out", str(out), "--json", *FAST])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == str(out / "report.json")
    assert json.loads((out / "report.json").read_text())["items"][0]["latents"] is None


def test_models_lists_registry(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # not the user's
    (tmp_path / "Wan2.1-T2V-1.3B-Diffusers").mkdir()
    result = runner.invoke(app, ["models", "--json", "--model-root", str(tmp_path)])
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {
        "tiny-wan",
        "wan2.1-1.3b",
        "wan2.1-14b",
        "wan2.1-i2v-14b-480p",
        "wan2.1-i2v-14b-720p",
        "wan2.2-t2v-a14b",
        "wan2.2-i2v-a14b",
        "wan2.2-ti2v-5b",
        "hunyuanvideo",
        "hunyuanvideo-1.5-480p-t2v",
        "hunyuanvideo-1.5-720p-t2v",
        "hunyuanvideo-1.5-480p-i2v",
        "hunyuanvideo-1.5-720p-i2v",
        "skyreels-v2-t2v-14b-540p",
        "skyreels-v2-t2v-14b-720p",
        "skyreels-v2-i2v-1.3b-540p",
        "skyreels-v2-i2v-14b-540p",
        "skyreels-v2-i2v-14b-720p",
        "ltx-2",
    }
    assert rows["tiny-wan"]["resolves_to"] == "built-in"
    ltx = rows["ltx-2"]
    assert (ltx["family"], ltx["task"], ltx["heads"], ltx["layers"], ltx["defaults"]["frames"]) == (
        "ltx-2",
        "ti2v",
        32,
        48,
        121,
    )
    assert rows["wan2.1-1.3b"]["resolves_to"] == str(tmp_path / "Wan2.1-T2V-1.3B-Diffusers")
    assert rows["wan2.1-14b"]["resolves_to"] == "not found: ditango download wan2.1-14b"
    assert (rows["wan2.1-14b"]["heads"], rows["wan2.1-14b"]["layers"]) == (40, 40)
    a14b, ti2v = rows["wan2.2-t2v-a14b"], rows["wan2.2-ti2v-5b"]
    assert (a14b["task"], a14b["experts"], a14b["defaults"]["guidance_2"]) == ("t2v", 2, 3.0)
    assert (ti2v["task"], ti2v["heads"], ti2v["layers"], ti2v["defaults"]["frames"]) == ("ti2v", 24, 30, 121)
    assert rows["wan2.1-i2v-14b-720p"]["task"] == "i2v"
    hy = rows["hunyuanvideo"]
    assert (hy["family"], hy["heads"], hy["layers"], hy["head_dim"]) == ("hunyuanvideo", 24, 60, 128)
    hy15, sky = rows["hunyuanvideo-1.5-720p-t2v"], rows["skyreels-v2-i2v-1.3b-540p"]
    assert (hy15["family"], hy15["heads"], hy15["layers"], hy15["defaults"]["width"]) == (
        "hunyuanvideo-1.5",
        16,
        54,
        1280,
    )
    assert (sky["family"], sky["task"], sky["layers"], sky["defaults"]["guidance"]) == ("skyreels-v2", "i2v", 30, 5.0)


def test_builtin_params_match_registry():
    from runtime.models.registry import REGISTRY
    from tiny_wan import TRAINED_ARCH, build_tiny_wan

    transformer = build_tiny_wan(TRAINED_ARCH)["transformer"]
    spec = REGISTRY["tiny-wan"]
    assert sum(p.numel() for p in transformer.parameters()) == spec.params
    assert transformer.config.num_attention_heads == spec.heads
    assert transformer.config.num_layers == spec.layers


def test_check_resolves_without_generating(runner, saved_model_dir, tmp_path):
    out = tmp_path / "never"
    result = runner.invoke(
        app, ["check", "--model", str(saved_model_dir), "--prompt", "x", "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["model_path"] == str(saved_model_dir)
    assert summary["transformer"]["heads"] == 2 and summary["transformer"]["layers"] == 3
    assert summary["transformer"]["params"] > 0
    # Wan defaults for a user directory: 832x480, 81 frames -> 21 x 30 x 52 latent tokens / 4.
    assert summary["items"][0]["tokens"] == 21 * 30 * 52
    assert not out.exists()
