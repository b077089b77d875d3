"""HunyuanVideo-1.5 (runtime/models/hunyuan15/): a tiny random model saved in diffusers' layout
runs through `ditango generate` as `HunyuanVideo15Pipeline` runs it, on 1 process and under
ring and Ulysses on 2 ranks; its guider's scale is the default guidance; its counts restate
what its configs build."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ditango_cli.app import app
from runtime.models import hunyuan15
from runtime.models.registry import REGISTRY
from tiny_wan.hunyuan15 import build_tiny_hunyuan15

PROMPT = 'a red fox holds a sign that says "hello"'
NEGATIVE = "blurry, static"
SIZE = {"height": 32, "width": 48, "frames": 5}  # 2 x 2 x 3 latents: 12 tokens
STEPS = 2
PARITY = 1e-4  # the bound; float32 on CPU is ~1e-6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import HunyuanVideo15Pipeline

    path = tmp_path_factory.mktemp("hv15") / "model"
    HunyuanVideo15Pipeline(**build_tiny_hunyuan15()).save_pretrained(path, safe_serialization=True)
    return path


def _args(folder, out, *extra: str) -> list[str]:
    size = [f"--{k}={v}" for k, v in SIZE.items()]
    run = ["--steps", str(STEPS), "--seed", "5", "--device", "cpu", "--quiet", "--save-latents", "--out", str(out)]
    return ["generate", "--model", str(folder), "--prompt", PROMPT, *size, *run, *extra]


def _run(runner, folder, out, *extra: str) -> tuple[torch.Tensor, dict]:
    result = runner.invoke(app, _args(folder, out, *extra))
    assert result.exit_code == 0, result.stderr
    (file,) = out.glob("*.latents.safetensors")
    (item,) = json.loads((out / "report.json").read_text())["items"]
    return next(iter(load_file(file).values())), item


def _pipeline(folder, guidance: float | None = None, negative: str | None = None) -> torch.Tensor:
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, local_files_only=True)
    if guidance is not None:
        pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=PROMPT,
        negative_prompt=negative,
        height=SIZE["height"],
        width=SIZE["width"],
        num_frames=SIZE["frames"],
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="latent",
    ).frames


def test_one_process_equals_the_pipeline(runner, folder, tmp_path):
    """The guider's own scale by default (recorded), a given one and a negative prompt after."""
    guider = json.loads((folder / "guider" / "guider_config.json").read_text())["guidance_scale"]
    got, item = _run(runner, folder, tmp_path / "own")
    assert item["guidance"] == guider and item["tokens"] == 12
    assert (got - _pipeline(folder)).abs().max().item() <= PARITY
    got, item = _run(runner, folder, tmp_path / "given", "--guidance", "3.5", "--negative-prompt", NEGATIVE)
    assert item["guidance"] == 3.5
    assert (got - _pipeline(folder, 3.5, NEGATIVE)).abs().max().item() <= PARITY


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_two_ranks_equal_one_process(runner, folder, tmp_path, strategy):
    alone, _ = _run(runner, folder, tmp_path / "one")
    two, _ = _run(runner, folder, tmp_path / "two", "--parallel", strategy, "--gpus", "2", "--executor", "local")
    assert (two - alone).abs().max().item() <= PARITY


def test_a_folders_guider_scale_is_the_default_and_others_are_refused(runner, folder, tmp_path):
    """A guider config's scale is what a run uses without --guidance; a guider setting the
    loop does not run (a rescale) is refused in one line."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    file = copy / "guider" / "guider_config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({**config, "guidance_scale": 2.25}))
    size = [f"--{k}={v}" for k, v in SIZE.items()]
    check = ["check", "--model", str(copy), "--prompt", "x", *size, "--json", "--out", str(tmp_path / "o")]
    result = runner.invoke(app, check)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["items"][0]["guidance"] == 2.25
    file.write_text(json.dumps({**config, "guidance_rescale": 0.7}))
    result = runner.invoke(app, check)
    assert result.exit_code == 2 and "guidance_rescale 0.7 is not supported" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_counts_restate_the_configs():
    """The block count the memory model uses is the meta-device block's; each named model's
    transformer, VAE and text encoders are what their configs build."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    from runtime.models.hunyuan15.checkpoint import BYT5_SMALL, QWEN25_VL_7B_TEXT
    from runtime.models.meta import _transformers_model

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    for model in hunyuan15.MODELS:
        config = {**model.transformer, "num_layers": 1}
        with torch.device("meta"):
            one = HunyuanVideo15Transformer3DModel(**config)
            vae = AutoencoderKLHunyuanVideo15(**model.vae)
        assert count(one.transformer_blocks[0]) == hunyuan15.block_params(model.transformer)
        assert count(vae) == model.vae_params
        spec = REGISTRY[model.name]
        assert spec.defaults.vae_stride == 16 and spec.shape.vae.spatial == 16
    with torch.device("meta"):
        qwen = _transformers_model("Qwen2_5_VLTextModel", QWEN25_VL_7B_TEXT)
        byt5 = _transformers_model("T5EncoderModel", BYT5_SMALL)
    text = hunyuan15.MODELS[0].text
    assert (count(qwen) + count(byt5), count(qwen.layers[0]), text.whole) == (text.params, text.block, count(byt5))


@pytest.mark.e2e
def test_a_rehearsal_runs_the_forwards_text_reorder(runner, folder):
    """Bug: the forward's boolean text reorder (valid tokens first) has no size on fake tensors
    and stopped every HunyuanVideo-1.5 rehearsal in its denoise (DynamicOutputShapeException:
    aten.nonzero). The tiny model rehearses through every phase, each selection read once a
    forward (2 steps x 2 CFG branches); its sizes are too small for the memory model's figures
    (the 720p check is tests/test_rehearse.py's)."""
    size = [f"--{k}={v}" for k, v in SIZE.items()]
    args = ["rehearse", "--model", str(folder), *size, "--steps", "2", "--nodes", "1", "--gpus-per-node", "2"]
    result = runner.invoke(app, [*args, "--parallel", "ring", "--json"])
    report = json.loads(result.stdout)
    assert not [p for p in report["problems"] if "Error" in p or "Exception" in p], report["problems"]
    for rank in report["ranks"]:
        assert set(rank["phases"]) == {"load", "encode", "denoise", "decode"} and rank["peak"] is not None
        reads = [r for r in rank["host_reads"] if "transformer_hunyuan_video15" in r["site"]]
        assert len(reads) >= 6 and all(r["count"] == 4 for r in reads), reads


def test_the_vae_shape_holds_each_resolutions_own_width():
    """Bug: the memory model counted each upsampled resolution of the decoder at the wider
    block's channels (HunyuanVideo's interpolate-then-convolve upsampler), twice what this
    VAE's pixel-shuffle upsampler leaves there: the 720p tiled decode was modelled at 2x its
    traced working set (`ditango rehearse`, tests/test_rehearse.py)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    with torch.device("meta"):
        decoder = AutoencoderKLHunyuanVideo15(**hunyuan15.MODELS[0].vae).decoder
    # a block's resnets run at one resolution, the one its predecessor's upsampler made
    widths = tuple(block.resnets[-1].conv2.conv.out_channels for block in decoder.up_blocks)
    assert widths == (1024, 1024, 512, 256, 128)
    for model in hunyuan15.MODELS:
        assert REGISTRY[model.name].shape.vae.widths == widths


def test_an_image_to_video_folder_is_refused_in_one_line(runner, tmp_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    folder = tmp_path / "i2v"
    HunyuanVideo15ImageToVideoPipeline(**build_tiny_hunyuan15(image=True)).save_pretrained(
        folder, safe_serialization=True
    )
    result = runner.invoke(app, ["check", "--model", str(folder), "--prompt", "x", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "image-to-video (HunyuanVideo15ImageToVideoPipeline) is not supported yet" in (
        result.stderr
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_lora_is_refused_in_one_line(runner, folder, tmp_path):
    """diffusers has no LoRA loader for HunyuanVideo-1.5: a --lora is refused before anything loads."""
    from safetensors.torch import save_file

    lora = tmp_path / "style.safetensors"
    save_file({"transformer.x.lora_A.weight": torch.zeros(2, 2)}, str(lora))
    size = [f"--{k}={v}" for k, v in SIZE.items()]
    args = ["check", "--model", str(folder), "--prompt", "x", *size, "--lora", str(lora), "--out", str(tmp_path / "o")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "LoRA is not supported for HunyuanVideo15Pipeline" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
