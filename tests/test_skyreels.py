"""SkyReels-V2 (runtime/models/skyreels/): tiny random text- and image-to-video folders saved by
diffusers' own pipelines run through `ditango generate` as the pipelines run them on 1 process,
and as on 1 process under ring, Ulysses and tp on 2 local ranks; a diffusion-forcing folder,
or a transformer only diffusion forcing drives, is refused in one line; the named models'
counts and defaults are those of the configs and the pipelines."""

from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from ditango_cli.app import app
from runtime.errors import ModelDirError
from runtime.models import skyreels
from runtime.models.checkpoint import inspect_model_dir
from runtime.models.registry import REGISTRY, Defaults
from tests.conftest import refused
from tiny_wan.skyreels import build_tiny_skyreels

PROMPT, NEGATIVE, SEED, STEPS = "a red circle moving left", "blurry, static", 4, 3
SIZE = dict(height=32, width=32, num_frames=5)  # 2 x 4 x 4 latents, 8 tokens
RUN = ["--prompt", PROMPT, "--steps", str(STEPS), "--height", "32", "--width", "32", "--frames", "5",
       "--seed", str(SEED), "--device", "cpu", "--quiet", "--save-latents"]  # fmt: skip
# Float32 on CPU: the same operations in another order (the strategies' partial attention, another
# process's thread count) move the last bits only; a wrong input or a missed token is far above it.
PARITY = 1e-4
I2V_ARGS = ["--guidance", "5", "--negative-prompt", NEGATIVE]


def _pipeline_class(kind: str):
    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline

    return SkyReelsV2ImageToVideoPipeline if kind == "i2v" else SkyReelsV2Pipeline


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """{"t2v", "i2v": a tiny random model saved by its pipeline, "image": a PNG not the video's size}."""
    root = tmp_path_factory.mktemp("skyreels")
    found = {}
    for kind in ("t2v", "i2v"):
        components = build_tiny_skyreels(image=kind == "i2v")
        _pipeline_class(kind)(**components).save_pretrained(root / kind, safe_serialization=True)
        found[kind] = root / kind
    found["image"] = root / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 72, 3), dtype=np.uint8)).save(found["image"])
    return found


def _generate(folder, out, *extra: str) -> torch.Tensor:
    result = CliRunner().invoke(app, ["generate", "--model", str(folder), *RUN, *extra, "--out", str(out)])
    assert result.exit_code == 0, result.stderr[-3000:]
    (file,) = out.glob("*.latents.safetensors")
    return next(iter(load_file(file).values()))


def _extra(kind: str, folders: dict) -> list[str]:
    return [*I2V_ARGS, "--image", str(folders["image"])] if kind == "i2v" else []


@pytest.fixture(scope="module")
def one_process(folders, tmp_path_factory) -> dict:
    """{kind: (latents, report item)} of `ditango generate` on 1 process."""
    found = {}
    for kind in ("t2v", "i2v"):
        out = tmp_path_factory.mktemp(f"one-{kind}")
        latents = _generate(folders[kind], out, *_extra(kind, folders))
        (item,) = json.loads((out / "report.json").read_text())["items"]
        found[kind] = latents, item
    return found


def _diffusers_latents(kind: str, folders: dict) -> torch.Tensor:
    """The pipeline loaded from the folder, with its own defaults where the run took the folder's."""
    from diffusers.utils import load_image

    pipe = _pipeline_class(kind).from_pretrained(folders[kind], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {}
    if kind == "i2v":
        kwargs = {"image": load_image(str(folders["image"])), "guidance_scale": 5.0, "negative_prompt": NEGATIVE}
    return pipe(
        prompt=PROMPT,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="latent",
        max_sequence_length=Defaults().max_text_len,  # a folder's text length, as the CLI's
        **SIZE,
        **kwargs,
    ).frames


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_one_process_equals_the_pipeline(kind, folders, one_process):
    """A saved SkyReelsV2Pipeline / SkyReelsV2ImageToVideoPipeline folder through the CLI gives
    the pipeline's latents (text-to-video with the folder's defaults: guidance, negative prompt)."""
    got, item = one_process[kind]
    want = _diffusers_latents(kind, folders)
    assert got.shape == want.shape == (1, 16, 2, 4, 4) and bool(torch.isfinite(got).all())
    err = (got - want).abs().max().item()
    assert err <= PARITY, (kind, err)
    if kind == "t2v":
        assert (item["guidance"], item["fps"], item["negative_prompt"]) == (6.0, 24, "")
        assert item["flow_shift"] == 8.0  # the folder's scheduler
    else:
        assert item["image"] == str(folders["image"]) and item["flow_shift"] == 5.0


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("kind,strategy", [("t2v", "ring"), ("t2v", "ulysses"), ("i2v", "ring"), ("i2v", "tp")])
def test_two_ranks_equal_one_process(kind, strategy, folders, one_process, tmp_path):
    """Wan's parallel installation (and tp's splits, image keys included) on SkyReels-V2's
    transformer, 2 local ranks: the 1-process latents."""
    two = ["--parallel", strategy, "--gpus", "2", "--executor", "local"]
    got = _generate(folders[kind], tmp_path / "two", *_extra(kind, folders), *two)
    report = json.loads((tmp_path / "two" / "report.json").read_text())
    assert (report["layout"]["world_size"], report["layout"]["strategy"]) == (2, strategy)
    err = (got - one_process[kind][0]).abs().max().item()
    assert err <= PARITY, (kind, strategy, err)


def test_a_diffusion_forcing_folder_is_refused_in_one_line(folders, tmp_path):
    """Its pipeline is this family's, but its loop (per-frame noise levels, causal blocks) is not
    ditango's: one error line naming the checkpoints to use, no traceback."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    folder = tmp_path / "df"
    components = _pipeline_class("t2v").from_pretrained(folders["t2v"], local_files_only=True).components
    SkyReelsV2DiffusionForcingPipeline(**components).save_pretrained(folder, safe_serialization=True)
    result = CliRunner().invoke(app, ["check", "--model", str(folder), "--prompt", "x", "--out", str(tmp_path / "o")])
    refused(result, "SkyReelsV2DiffusionForcingPipeline", "diffusion forcing", "skyreels-v2-t2v-14b-540p")


@pytest.mark.parametrize(
    "kind,change,needle",
    [
        ("t2v", {"inject_sample_info": True}, "inject_sample_info True asks for an fps embedding"),
        ("t2v", {"num_frame_per_block": 5}, "num_frame_per_block 5 asks for a causal block mask"),
        ("i2v", {"pos_embed_seq_len": 514}, "pos_embed_seq_len 514 asks for first- and last-frame"),
        ("i2v", {"image_dim": None}, "the transformer has no image_dim"),
        ("t2v", {"in_channels": 36, "image_dim": 32}, "image-to-video is SkyReelsV2ImageToVideoPipeline"),
    ],
)
def test_what_only_another_loop_runs_is_refused(kind, change, needle, folders, tmp_path):
    folder = tmp_path / kind
    shutil.copytree(folders[kind], folder)
    assert inspect_model_dir(folder).variant == (skyreels.I2V if kind == "i2v" else skyreels.T2V)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(ModelDirError, match=needle):
        inspect_model_dir(folder)


def test_a_vae_the_pipelines_would_size_wrongly_is_refused(folders, tmp_path):
    """The pipelines size latents from `temperal_downsample` (8x for three levels): a VAE that
    says it compresses 16x (Wan2.2's) would get latents of the wrong size."""
    folder = tmp_path / "m"
    shutil.copytree(folders["t2v"], folder)
    config = folder / "vae" / "config.json"
    vae = json.loads(config.read_text())
    assert skyreels.vae_strides(vae) == (vae["scale_factor_temporal"], vae["scale_factor_spatial"]) == (4, 8)
    config.write_text(json.dumps({**vae, "scale_factor_spatial": 16}))
    with pytest.raises(ModelDirError, match=r"compresses \(time, space\) \(4, 16\).*\(4, 8\)"):
        inspect_model_dir(folder)


def test_defaults_are_the_pipelines():
    """The family's and the named models' defaults restate the pipelines' __call__ signatures
    (and the 720p checkpoints' size); the VAE strides are what the pipelines compute."""
    from diffusers import AutoencoderKLWan

    for kind in ("t2v", "i2v"):
        signature = inspect.signature(_pipeline_class(kind).__call__).parameters
        want = {k: signature[k].default for k in ("height", "width", "num_frames", "num_inference_steps")}
        want["guidance_scale"] = signature["guidance_scale"].default
        for model in skyreels.MODELS:
            if (model.variant.image == "required") != (kind == "i2v"):
                continue
            d = REGISTRY[model.name].defaults
            size = {"height": 720, "width": 1280} if "720p" in model.name else {}
            assert {**want, **size} == {
                "height": d.height,
                "width": d.width,
                "num_frames": d.frames,
                "num_inference_steps": d.steps,
                "guidance_scale": d.guidance,
            }, model.name
            assert (d.fps, d.negative_prompt, d.max_text_len) == (24, "", signature["max_sequence_length"].default)
            assert (d.temporal_stride, d.vae_stride, d.patch) == (4, 8, (1, 2, 2))
    family = skyreels.PIPELINE_DEFAULTS
    t2v = inspect.signature(_pipeline_class("t2v").__call__).parameters
    assert (family["guidance"], family["frames"]) == (t2v["guidance_scale"].default, t2v["num_frames"].default)
    vae = inspect.signature(AutoencoderKLWan.__init__).parameters
    assert skyreels.vae_strides({}) == (vae["scale_factor_temporal"].default, vae["scale_factor_spatial"].default)


def test_named_models_are_their_configs():
    """Each named model's transformer config builds a SkyReelsV2Transformer3DModel of its
    counts: all parameters, one block (Wan's count), what --shard-weights gathers; the I2V
    image encoder is CLIP ViT-H/14 with its projection; the meta build is the named parts."""
    from diffusers import SkyReelsV2Transformer3DModel

    from runtime.models.meta import meta_components
    from runtime.weights import _main_dtype, block_stacks

    assert len(skyreels.MODELS) == 5 and len({m.name for m in skyreels.MODELS}) == 5
    for model in skyreels.MODELS:
        config = model.transformer
        assert set(config) <= set(SkyReelsV2Transformer3DModel.extract_init_dict(config)[0]), model.name
        with torch.device("meta"):
            one = SkyReelsV2Transformer3DModel(**{**config, "num_layers": 1})
        assert sum(p.numel() for p in one.blocks[0].parameters()) == skyreels.block_params(config), model.name
        assert model.params == skyreels.count_params(config)
    for name in ("skyreels-v2-t2v-14b-540p", "skyreels-v2-i2v-1.3b-540p"):
        spec = REGISTRY[name]
        parts = meta_components(spec, None, torch.bfloat16, 512)
        transformer = parts["transformer"]
        assert type(transformer) is SkyReelsV2Transformer3DModel
        main = _main_dtype(transformer)
        units = {id(p) for b in block_stacks(transformer) for p in b.parameters()}
        gathered = sum(p.numel() for b in block_stacks(transformer) for p in b.parameters() if p.dtype == main)
        root = sum(p.numel() for p in transformer.parameters() if id(p) not in units and p.dtype == main)
        assert (gathered, root) == (spec.named.fsdp_gathered, spec.named.fsdp_root_gathered), name
        assert sum(p.numel() for p in parts["text_encoder"].parameters()) == spec.named.text.params
        image = parts.get("image_encoder")
        if spec.variant.image_encoder:
            assert type(image).__name__ == "CLIPVisionModelWithProjection"
            assert sum(p.numel() for p in image.parameters()) == spec.shape.image_encoder_params
        else:
            assert image is None and spec.shape.image_encoder_params == 0
