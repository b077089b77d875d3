"""The family protocol (runtime/models/families.py, protocol.py): a family defined in a test file
registers and runs under ring 2 with nothing edited outside its module; a VAE's strides are its
family's reading of its own config (a 16x VAE is never taken as 8x); the registry's records
are each family's own."""

from __future__ import annotations

import json

import imageio.v3 as iio
import pytest
import torch
from safetensors.torch import load_file

from ditango_cli.app import app
from runtime.models.families import FAMILIES
from runtime.models.registry import REGISTRY, register_family, unregister_family
from tests import toy_family
from tiny_wan import TinyWanConfig, build_tiny_wan

TINY = dict(seed=11, heads=2, head_dim=12, layers=2, ffn_dim=32, text_dim=24, text_heads=2)
RUN = ["--prompt", "a red circle moving left", "--steps", "2", "--height", "32", "--width", "32", "--frames", "5",
       "--seed", "4", "--device", "cpu", "--quiet", "--save-latents"]  # fmt: skip
EXACT = 1e-5  # ring is exact: float32 on CPU differs only in summation order


@pytest.fixture
def toy(monkeypatch):
    """The toy family, registered here and (through the environment) in every rank."""
    monkeypatch.setenv("DITANGO_FAMILIES", "tests.toy_family")
    register_family(toy_family.KEY, toy_family)
    yield toy_family
    unregister_family(toy_family.KEY)


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    """A tiny random model saved by the toy's own pipeline class (its model_index.json names
    ToyPipeline and ToyTransformer3DModel, classes diffusers does not have)."""
    components = build_tiny_wan(TinyWanConfig(**TINY))
    wan_transformer = components["transformer"]
    transformer = toy_family.ToyTransformer3DModel.from_config(wan_transformer.config)
    transformer.load_state_dict(wan_transformer.state_dict())
    components["transformer"] = transformer.eval()
    folder = tmp_path_factory.mktemp("toy") / "model"
    toy_family.ToyPipeline(**components).save_pretrained(folder, safe_serialization=True)
    return folder


def _latents(out) -> torch.Tensor:
    (file,) = out.glob("*.latents.safetensors")
    return next(iter(load_file(file).values()))


@pytest.mark.distributed
def test_a_family_from_a_test_file_runs_under_ring_2(runner, toy, toy_folder, tmp_path):
    """Registered from its own module only: its folder resolves to it, loads its own classes,
    runs on 1 process as its pipeline does, and under ring on 2 local ranks (spawned processes,
    which register it from DITANGO_FAMILIES) as on 1; its defaults (PIPELINE_DEFAULTS) apply."""
    index = json.loads((toy_folder / "model_index.json").read_text())
    assert index["_class_name"] == "ToyPipeline" and index["transformer"][1] == "ToyTransformer3DModel"
    one, two = tmp_path / "one", tmp_path / "two"
    result = runner.invoke(app, ["generate", "--model", str(toy_folder), *RUN, "--out", str(one)])
    assert result.exit_code == 0, result.stderr
    ring = ["--parallel", "ring", "--gpus", "2", "--executor", "local"]
    result = runner.invoke(app, ["generate", "--model", str(toy_folder), *RUN, *ring, "--out", str(two)])
    assert result.exit_code == 0, result.stderr
    report = json.loads((two / "report.json").read_text())
    assert report["layout"]["world_size"] == 2 and report["layout"]["strategy"] == "ring"
    (item,) = report["items"]
    assert item["fps"] == toy.PIPELINE_DEFAULTS["fps"] and item["guidance"] == toy.PIPELINE_DEFAULTS["guidance"]
    got, alone = _latents(two), _latents(one)
    assert (got - alone).abs().max().item() <= EXACT

    pipe = toy.ToyPipeline.from_pretrained(toy_folder, local_files_only=True)
    assert isinstance(pipe.transformer, toy.ToyTransformer3DModel)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt=RUN[1],
        negative_prompt="",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=toy.PIPELINE_DEFAULTS["guidance"],
        generator=torch.Generator("cpu").manual_seed(4),
        output_type="latent",
        max_sequence_length=REGISTRY["toy-video"].defaults.max_text_len,
    ).frames
    assert (alone - want).abs().max().item() <= EXACT


def test_a_registered_family_is_checked_and_can_leave(toy):
    """Its named model is in the registry with its own sizes; registering a family that lacks a
    member of the protocol, or claims another family's classes, is refused in one line."""
    spec = REGISTRY["toy-video"]
    assert spec.family == "toy" and spec.defaults.vae_stride == 4 and spec.shape.layers == 2
    assert spec.params == toy.count_params(toy.TOY_CONFIG)

    class Partial:
        TRANSFORMER_CLASS, PIPELINES = "X", ("XPipeline",)

    with pytest.raises(TypeError, match="lacks .*MODELS"):
        register_family("partial", Partial)
    with pytest.raises(ValueError, match="already registered"):
        register_family("toy", object())
    unregister_family("toy")
    assert "toy" not in FAMILIES and "toy-video" not in REGISTRY
    register_family("toy", toy)


def test_a_folders_own_configs_are_its_defaults(runner, toy, toy_folder, tmp_path):
    """The defaults a folder's files set (the family's FOLDER_DEFAULTS) are what a run without
    those flags uses and records; a flag still wins; a value of the wrong type is one line."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(toy_folder, folder)
    (folder / "guider").mkdir()
    (folder / "guider" / "guider_config.json").write_text(json.dumps({"guidance_scale": 4.5}))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "fps": 10}))

    def item(*flags: str) -> tuple[int, dict | str]:
        result = runner.invoke(
            app, ["check", "--model", str(folder), "--prompt", "x", "--out", str(tmp_path / "o"), "--json", *flags]
        )
        return result.exit_code, json.loads(result.stdout)["items"][0] if result.exit_code == 0 else result.stderr

    code, own = item()
    assert code == 0 and (own["guidance"], own["fps"]) == (4.5, 10), own
    code, given = item("--guidance", "2", "--fps", "9")
    assert code == 0 and (given["guidance"], given["fps"]) == (2.0, 9), given
    (folder / "model_index.json").write_text(json.dumps({**index, "fps": "ten"}))
    code, error = item()
    assert code == 2 and "model_index.json: fps must be a positive int, got 'ten'" in error, error
    assert len(error.strip().splitlines()) == 1


def _hunyuan_with_a_16x_vae(folder) -> None:
    """The tiny HunyuanVideo with a five-block AutoencoderKLHunyuanVideo compressing 16x in space
    (the key is `spatial_compression_ratio`, not Wan's `scale_factor_spatial`)."""
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline

    from tiny_wan.hunyuan import build_tiny_hunyuan

    components = build_tiny_hunyuan()
    torch.manual_seed(0)
    components["vae"] = AutoencoderKLHunyuanVideo(
        latent_channels=components["vae"].config.latent_channels,
        down_block_types=("HunyuanVideoDownBlock3D",) * 5,
        up_block_types=("HunyuanVideoUpBlock3D",) * 5,
        block_out_channels=(8,) * 5,
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    ).eval()
    HunyuanVideoPipeline(**components).save_pretrained(folder, safe_serialization=True)


def test_a_16x_vae_is_never_taken_as_8x(runner, tmp_path):
    """The token count a run records, its latents and its video follow the VAE's own 16x: a
    64x96 video of 5 frames is 2 x 4 x 6 latents, 2 x 2 x 3 = 12 tokens (at 8x it would be 48)."""
    folder = tmp_path / "hunyuan16"
    _hunyuan_with_a_16x_vae(folder)
    out = tmp_path / "out"
    size = ["--height", "64", "--width", "96", "--frames", "5", "--steps", "1", "--seed", "0"]
    result = runner.invoke(
        app, ["generate", "--model", str(folder), "--prompt", "a cat", *size, "--out", str(out), "--save-latents"]
    )
    assert result.exit_code == 0, result.stderr
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["tokens"] == 2 * 2 * 3
    assert tuple(_latents(out).shape[2:]) == (2, 4, 6)
    (video,) = out.glob("*.mp4")
    frames = iio.imread(video)
    assert frames.shape[:3] == (5, 64, 96)
    checked = runner.invoke(app, ["check", "--model", str(folder), "--prompt", "x", *size, "--json"])
    assert checked.exit_code == 0, checked.stderr
    assert json.loads(checked.stdout)["items"][0]["tokens"] == 12


def test_a_family_that_cannot_register_is_one_line(tmp_path):
    """A module in DITANGO_FAMILIES that is missing, or is no family, stops the command in one
    line with exit 2 (the registry is imported before any command parses its options)."""
    import os
    import subprocess
    import sys

    for module, needle in (("no_such_module", "No module named 'no_such_module'"), ("json", "lacks COMPONENTS")):
        env = {**os.environ, "DITANGO_FAMILIES": module}
        done = subprocess.run(
            [sys.executable, "-m", "ditango_cli.app", "models"], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and needle in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
