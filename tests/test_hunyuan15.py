"""HunyuanVideo-1.5 (runtime/models/hunyuan15/): tiny random text- and image-to-video models saved
in diffusers' layout run through `ditango generate` as `HunyuanVideo15Pipeline` and
`HunyuanVideo15ImageToVideoPipeline` run them, on 1 process and under ring and Ulysses on 2
ranks; its guider's scale is the default guidance; its counts restate what its configs build."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

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
    transformer, VAE, text encoders and (image-to-video) SigLIP are what their configs build."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    from runtime.models.hunyuan15.checkpoint import BYT5_SMALL, QWEN25_VL_7B_TEXT, SIGLIP_SO400M
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
    with torch.device("meta"):
        siglip = _transformers_model("SiglipVisionModel", SIGLIP_SO400M)
    for model in hunyuan15.MODELS:
        image = REGISTRY[model.name].variant.image == "required"
        assert model.image_encoder_params == (count(siglip) if image else 0), model.name


# (name, repo, flow shift, a 16:9 image's size, a 9:16 one's): the buckets are not symmetric
# (a portrait image takes the closest bucket no taller than it).
I2V_MODELS = [
    ("hunyuanvideo-1.5-480p-i2v", "480p_i2v", 5.0, (480, 848), (848, 480)),
    ("hunyuanvideo-1.5-720p-i2v", "720p_i2v", 7.0, (720, 1280), (1264, 720)),
]


@pytest.mark.parametrize("name, repo, shift, landscape, portrait", I2V_MODELS)
def test_named_image_to_video_models_are_the_community_checkpoints(name, repo, shift, landscape, portrait):
    """The transformer is text-to-video's marked "i2v"; the flow shift is the conversion
    script's (7.0 at 720p, not text-to-video's 9.0); a 16:9 image makes the default size; the
    meta build has SigLIP and a processor at its input size."""
    from runtime.models.meta import meta_components, meta_scheduler

    spec = REGISTRY[name]
    config = spec.named.transformer
    assert spec.repo_id == f"hunyuanvideo-community/HunyuanVideo-1.5-{repo}"
    assert (spec.variant.pipeline, spec.defaults.image) == ("HunyuanVideo15ImageToVideoPipeline", "required")
    assert config["task_type"] == "i2v" and spec.params == hunyuan15.count_params(config)
    assert meta_scheduler(spec, None).config.shift == shift
    assert (spec.defaults.height, spec.defaults.width) == landscape == spec.defaults.size_of_image(1080, 1920)
    assert spec.defaults.size_of_image(1920, 1080) == portrait
    parts = meta_components(spec, None, torch.bfloat16, 64)
    assert sum(p.numel() for p in parts["image_encoder"].parameters()) == spec.shape.image_encoder_params
    assert parts["feature_extractor"].size == {"height": 384, "width": 384}


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
    # A line per rank as it finishes, with the time so far (a long rehearsal is not silent).
    said = [ln for ln in result.stderr.splitlines() if " rehearsed: " in ln]
    assert [ln.split(" rehearsed")[0] for ln in said] == [f"rank {r['rank']}/2" for r in report["ranks"]], said
    assert all(ln.endswith(" s elapsed") for ln in said), said


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


@pytest.fixture(scope="module")
def i2v(tmp_path_factory) -> dict:
    """{"model": a tiny image-to-video folder saved by its pipeline, "meanflow": the same with a
    MeanFlow transformer, "image": a 40 x 72 PNG, of which the pipeline makes a 32 x 48 video}."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    root = tmp_path_factory.mktemp("hv15-i2v")
    found = {"image": root / "first.png"}
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 72, 3), dtype=np.uint8)).save(found["image"])
    for name, meanflow in (("model", False), ("meanflow", True)):
        found[name] = root / name
        components = build_tiny_hunyuan15(image=True, meanflow=meanflow)
        HunyuanVideo15ImageToVideoPipeline(**components).save_pretrained(found[name], safe_serialization=True)
    return found


def _i2v_run(runner, i2v, out, *extra: str, model: str = "model") -> tuple[torch.Tensor, dict]:
    run = ["--steps", str(STEPS), "--seed", "5", "--device", "cpu", "--quiet", "--save-latents", "--out", str(out)]
    args = ["generate", "--model", str(i2v[model]), "--prompt", PROMPT, "--image", str(i2v["image"]), *run]
    result = runner.invoke(app, [*args, f"--frames={SIZE['frames']}", *extra])
    assert result.exit_code == 0, result.stderr
    (file,) = out.glob("*.latents.safetensors")
    (item,) = json.loads((out / "report.json").read_text())["items"]
    return next(iter(load_file(file).values())), item


def _i2v_pipeline(folder, image) -> torch.Tensor:
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        image=image,
        prompt=PROMPT,
        num_frames=SIZE["frames"],
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="latent",
    ).frames


@pytest.fixture(scope="module")
def i2v_alone(i2v, tmp_path_factory) -> torch.Tensor:
    """The image-to-video item on one process, at the size the pipeline picks for its image."""
    latents, item = _i2v_run(CliRunner(), i2v, tmp_path_factory.mktemp("i2v-one"))
    assert (item["height"], item["width"], item["tokens"]) == (32, 48, 12)
    return latents


def test_image_to_video_equals_the_pipeline(runner, i2v, i2v_alone, tmp_path):
    """HunyuanVideo15ImageToVideoPipeline picks the video's size from the image's (40 x 72 makes
    32 x 48), crops the image to it, and conditions on its SigLIP tokens and its first-frame
    latents. A given size is the item's: the image is cropped to it (the pipeline, which takes
    no size, is given the image already cropped so). MeanFlow's second timestep as it passes it."""
    from diffusers.utils import load_image

    image = load_image(str(i2v["image"]))
    err = (i2v_alone - _i2v_pipeline(i2v["model"], image)).abs().max().item()
    assert err <= PARITY, err
    got, item = _i2v_run(runner, i2v, tmp_path / "portrait", "--height", "48", "--width", "32")
    assert (item["height"], item["width"]) == (48, 32)
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    cropped = processor.resize(image, height=48, width=32, resize_mode="crop")
    err = (got - _i2v_pipeline(i2v["model"], cropped)).abs().max().item()
    assert err <= PARITY, err
    assert json.loads((i2v["meanflow"] / "transformer" / "config.json").read_text())["use_meanflow"]
    got, _ = _i2v_run(runner, i2v, tmp_path / "meanflow", model="meanflow")
    err = (got - _i2v_pipeline(i2v["meanflow"], image)).abs().max().item()
    assert err <= PARITY, err


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_image_to_video_on_two_ranks_equals_one_process(runner, i2v, i2v_alone, tmp_path, strategy):
    """The condition latents are channels of the video tokens (sharded with them), the SigLIP
    tokens part of the joint text (whole on every rank)."""
    two, _ = _i2v_run(runner, i2v, tmp_path, "--parallel", strategy, "--gpus", "2", "--executor", "local")
    err = (two - i2v_alone).abs().max().item()
    assert err <= PARITY, (strategy, err)


@pytest.mark.e2e
def test_an_image_to_video_rehearsal_encodes_the_image_and_runs_meanflow(runner, i2v):
    """The meta build stands in SigLIP's processor (`feature_extractor`, which a folder has no
    config.json for: the build stopped reading it), and the image's encode and MeanFlow's
    timestep lookup run on fake tensors, through every phase."""
    args = ["rehearse", "--model", str(i2v["meanflow"]), "--image", str(i2v["image"]), "--frames", "5"]
    args += ["--steps", "2", "--nodes", "1", "--gpus-per-node", "2", "--parallel", "ring", "--json"]
    report = json.loads(runner.invoke(app, args).stdout)
    assert not [p for p in report["problems"] if "Error" in p or "Exception" in p], report["problems"]
    for rank in report["ranks"]:
        assert set(rank["phases"]) == {"load", "encode", "denoise", "decode"} and rank["peak"] is not None


def test_an_image_is_required_by_image_to_video_only(runner, folder, i2v, tmp_path):
    """A text-to-video folder given --image, an image-to-video one without it: one line, exit 2."""
    size = [f"--{k}={v}" for k, v in SIZE.items()]
    base = ["generate", "--prompt", "x", *size, "--device", "cpu", "--out", str(tmp_path / "o")]
    for model, extra, needle in (
        (folder, ["--image", str(i2v["image"])], "this model is text-to-video and takes no image"),
        (i2v["model"], [], "this model is image-to-video: give --image PATH"),
    ):
        result = runner.invoke(app, [*base, "--model", str(model), *extra])
        assert result.exit_code == 2 and needle in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_an_image_to_video_folder_without_its_image_encoder_is_refused(i2v, tmp_path):
    from runtime.errors import ModelDirError
    from runtime.models.checkpoint import inspect_model_dir

    copy = tmp_path / "model"
    shutil.copytree(i2v["model"], copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "feature_extractor"}))
    with pytest.raises(ModelDirError, match="a HunyuanVideo15ImageToVideoPipeline without feature_extractor"):
        inspect_model_dir(copy)


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
