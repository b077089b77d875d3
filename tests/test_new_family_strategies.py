"""HunyuanVideo-1.5 and SkyReels-V2 (text-to-video) under the strategies and features that
tests/test_hunyuan15.py and tests/test_skyreels.py leave out (ring, Ulysses and tp are there):
tiny random folders saved by diffusers' pipelines, run through `ditango generate` on 1 process
and on 2 or 4 local ranks.

- exact, within PARITY of the 1-process latents: USP (Ulysses 2 x ring 2: the smallest layout
  where it is neither ring nor Ulysses, so 4 ranks) with sharded weights (FSDP2), CFG-parallel
  with the VAE's tiles decoded over both ranks;
- a step cache (first-block, whose decision is data-dependent): 2 ranks decide as one process,
  with skipped and computed steps in the record, and give its latents;
- DiTango (lossy by design): reuse happens, one plan on every rank, and --reference exact
  records a small error; Hybridiff: its stages and each rank's block evaluations recorded;
- what a family cannot do is one line, exit 2; the defaults diffusers' pipelines derive (a
  HunyuanVideo-1.5 folder's size from its target size, a SkyReels-V2 I2V folder's guidance);
- the bugs these runs found, each guarded cheaply too: FSDP2 hid the text encoders' hidden
  states (HunyuanVideo's and HunyuanVideo-1.5's), HunyuanVideo-1.5's VAE tiles off the 64 px grid.

Each folder and the 1-process runs are made once per module.
"""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from ditango_cli.app import app
from tests.conftest import refused

# Float32 on CPU: another reduction order (partial attention, FSDP's gathers, another process's
# threads) moves the last bits only; a missed token or a wrong branch is far above it.
PARITY = 1e-4
STEPS = 4
LOCAL = ["--executor", "local"]


@dataclass(frozen=True)
class Tiny:
    """A family's tiny folder and the run settings its tests use."""

    pipeline: str  # the diffusers class that saves the folder
    prompt: str
    size: tuple[int, int, int]  # height, width, frames
    vae_tile: int  # px: more than one tile of the video, for the parallel decode
    threshold: float  # first-block's, skipping some steps of this model and not others
    layers: int

    def components(self) -> dict:
        if self.pipeline == "HunyuanVideo15Pipeline":
            from tiny_wan.hunyuan15 import build_tiny_hunyuan15

            return build_tiny_hunyuan15()
        from tiny_wan.skyreels import build_tiny_skyreels

        return build_tiny_skyreels()


HV15_PROMPT = 'a red fox holds a sign that says "hello"'  # the quoted text runs the glyph encoder too
FAMILIES = {
    # 32 x 96 px: 2 x 2 x 6 latents, 24 tokens; 64 px tiles (4 latents, stride 3): 2 tiles.
    "hunyuanvideo-1.5": Tiny("HunyuanVideo15Pipeline", HV15_PROMPT, (32, 96, 5), 64, 0.4, 2),
    # 32 x 32 px: 2 x 4 x 4 latents, 8 tokens; 16 px tiles (stride 12): 16 tiles.
    "skyreels-v2": Tiny("SkyReelsV2Pipeline", "a red circle moving left", (32, 32, 5), 16, 0.1, 2),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """{family: a tiny folder saved by its pipeline}, and "skyreels-v2-i2v", "image"."""
    import diffusers

    from tiny_wan.skyreels import build_tiny_skyreels

    root = tmp_path_factory.mktemp("new-families")
    found = {}
    for family, tiny in FAMILIES.items():
        getattr(diffusers, tiny.pipeline)(**tiny.components()).save_pretrained(root / family, safe_serialization=True)
        found[family] = root / family
    found["skyreels-v2-i2v"] = root / "skyreels-v2-i2v"
    i2v = build_tiny_skyreels(image=True)
    diffusers.SkyReelsV2ImageToVideoPipeline(**i2v).save_pretrained(found["skyreels-v2-i2v"], safe_serialization=True)
    found["image"] = root / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 72, 3), dtype=np.uint8)).save(found["image"])
    return found


def _args(family: str, folders: dict, out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    tiny = FAMILIES[family]
    height, width, frames = tiny.size
    size = ["--height", str(height), "--width", str(width), "--frames", str(frames)]
    run = ["--steps", str(steps), "--seed", "5", "--device", "cpu", "--quiet", "--save-latents", "--out", str(out)]
    return ["generate", "--model", str(folders[family]), "--prompt", tiny.prompt, *size, *run, *extra]


def _generate(family: str, folders: dict, out: Path, *extra: str, steps: int = STEPS) -> tuple[torch.Tensor, dict]:
    """(final latents, report.json) of a run that must succeed."""
    result = CliRunner().invoke(app, _args(family, folders, out, *extra, steps=steps))
    assert result.exit_code == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (item,) = report["items"]
    return load_file(out / item["latents"])["latents"], report


@pytest.fixture(scope="module")
def one_process(folders, tmp_path_factory) -> dict[str, tuple[torch.Tensor, dict]]:
    """{family: (latents, report)} of `ditango generate` on 1 process, STEPS steps."""
    return {f: _generate(f, folders, tmp_path_factory.mktemp(f"one-{f}")) for f in FAMILIES}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and bool(torch.isfinite(a).all())
    return (a - b).abs().max().item()


# -- exact: the 1-process latents ---------------------------------------------------------------

EXACT = {
    # Both in one 4-rank run (each rank process is most of a run's time): FSDP2 over the cp group.
    "usp-sharded": ["--gpus", "4", "--parallel", "usp", "--ulysses-degree", "2", "--shard-weights"],
    "cfg-parallel": ["--gpus", "2", "--cfg-parallel"],  # and --vae-tile: tiles over both ranks
}


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("feature", list(EXACT))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_features_equal_one_process(family, feature, folders, one_process, tmp_path):
    """USP 2 x 2 with the weights sharded over its 4 ranks, and CFG-parallel with the VAE's
    tiles decoded over both ranks, give the 1-process latents. Bug guarded: --shard-weights on
    HunyuanVideo-1.5 failed in the text encoder ("'NoneType' object is not subscriptable":
    FSDP2's class swap hid Qwen's hidden states from transformers)."""
    extra = list(EXACT[feature])
    if feature == "cfg-parallel":
        extra += ["--vae-tile", str(FAMILIES[family].vae_tile)]
    latents, report = _generate(family, folders, tmp_path / "run", *extra, *LOCAL)
    alone, alone_report = one_process[family]
    err = _err(latents, alone)
    assert err <= PARITY, (family, feature, err)
    layout, item = report["layout"], report["items"][0]
    if feature == "usp-sharded":
        assert (layout["strategy"], layout["ulysses_degree"], layout["ring_degree"]) == ("usp", 2, 2)
        weights, whole = report["weights"], alone_report["weights"]
        assert (weights["shard_degree"], whole["shard_degree"]) == (4, 1)
        assert weights["param_bytes_per_rank"] < 0.6 * whole["param_bytes_per_rank"], (weights, whole)
    else:
        assert (layout["cfg_degree"], layout["cp_degree"]) == (2, 1)
        decode = item["decode"]  # the family's VAE tiles, decoded on both ranks
        assert (decode["mode"], decode["ranks"], decode["tile_px"]) == ("tiled", 2, FAMILIES[family].vae_tile)
        assert decode["tiles"] > 1 and decode["bytes"] > 0, decode


# -- step caches: the decisions of one process -----------------------------------------------------

STEP_CACHE_STEPS = 6


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_step_cache_decides_on_two_ranks_as_one_process(family, folders, tmp_path):
    """first-block on ring 2: the skip decision is agreed over the chunks, so both ranks skip the
    steps one process skips (some, not all) and give its latents. Bug guarded: any step cache
    that reads diffusers' block registry (first-block, MagCache) failed on both families ("Model
    class ... TransformerBlock not registered")."""
    cache = ["--step-cache", f"first-block:threshold={FAMILIES[family].threshold}"]
    steps = STEP_CACHE_STEPS
    alone, one = _generate(family, folders, tmp_path / "one", *cache, steps=steps)
    ring = ["--gpus", "2", "--parallel", "ring", *LOCAL]
    two, report = _generate(family, folders, tmp_path / "two", *cache, *ring, steps=steps)
    record, want = report["items"][0]["step_cache"], one["items"][0]["step_cache"]
    assert record["per_step"] == want["per_step"], (record["per_step"], want["per_step"])
    assert want["skipped_steps"]["cond"] and 0 < want["block_fraction"] < 1, want
    assert len(want["skipped_steps"]["cond"]) < steps - 1  # and computed steps after the first
    err = _err(two, alone)
    assert err <= PARITY, (family, err)


# -- lossy by design: what the record says ------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ditango_reuses_and_records_a_small_error(family, folders, tmp_path):
    """DiTango over 2 groups of 1 rank: reuse happens on its selective steps, every rank runs one
    plan, and --reference exact (the exact run in the same job) records a small error, not 0
    (states were reused) and far from a broken run."""
    ditango = ["--parallel", "ditango", "--group-size", "1", "--cache-ratio", "0.5", "--reuse", "always"]
    ditango += ["--warmup", "1", "--cooldown", "0", "--reference", "exact"]
    latents, report = _generate(family, folders, tmp_path / "run", "--gpus", "2", *ditango, *LOCAL, steps=6)
    assert bool(torch.isfinite(latents).all())
    assert (report["layout"]["strategy"], report["layout"]["group_size"]) == ("ditango", 1)
    item = report["items"][0]
    attention = item["attention"]
    assert len(attention["plan_hashes"]) == 2 and len(set(attention["plan_hashes"])) == 1
    assert attention["plan"]["kinds"][0] == "exact" and "selective" in attention["plan"]["kinds"]
    assert 0.0 < attention["computed_fraction_all_steps"] < 1.0, attention
    quality = item["quality"]
    # Measured on these tiny models: 0.0027 (HunyuanVideo-1.5) and 0.0033 (SkyReels-V2).
    assert quality["reference"] == "exact" and 0.0 < quality["latent_rel_err"] < 0.05, quality


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybridiff_records_its_stages(family, folders, one_process, tmp_path):
    """Hybridiff (k 2, tau1 1) over the two CFG branches: two CFG-parallel steps, then the
    pipeline's fill and one pipeline step, segment A (block 0) on the first rank and segment B
    (block 1) on the second; the latents approximate, not garbage."""
    hybrid = ["--gpus", "2", "--cfg-parallel", "--hybrid", "--hybrid-k", "2", "--hybrid-tau-cap", "1"]
    latents, report = _generate(family, folders, tmp_path / "run", *hybrid, *LOCAL)
    record = report["items"][0]["hybrid"]
    assert record["stages"] == ["cfg-parallel", "cfg-parallel", "pipeline-fill", "pipeline"], record
    layers = FAMILIES[family].layers
    assert record["block_evals"] == [[layers, layers, 0, 1], [layers, layers, layers, 1]], record
    alone = one_process[family][0]
    rel = ((latents - alone).norm() / alone.norm()).item()
    assert 0 < rel < 0.5, rel


# -- refused in one line --------------------------------------------------------------------------------

REFUSED = [
    ("hunyuanvideo-1.5", ["--parallel", "tp", "--gpus", "2"], "--parallel tp is not supported yet for joint text-video"),
    ("hunyuanvideo-1.5", ["--cfg-parallel", "--hybrid", "--hybrid-first-text", "uncond", "--gpus", "2"],
     "--hybrid-first-text uncond does not apply"),
    ("hunyuanvideo-1.5", ["--true-cfg-scale", "2"], "this model's --guidance is its CFG scale"),
    ("skyreels-v2", ["--true-cfg-scale", "2"], "this model's --guidance is its CFG scale"),
    ("hunyuanvideo-1.5", ["--guidance-2", "3"], "apply to two-expert models"),
    ("skyreels-v2", ["--guidance-2", "3"], "apply to two-expert models"),
    ("hunyuanvideo-1.5", ["--image", "IMAGE"], "this model is text-to-video and takes no image"),
    ("skyreels-v2", ["--image", "IMAGE"], "this model is text-to-video and takes no image"),
    ("skyreels-v2", ["--parallel", "usp", "--ulysses-degree", "4", "--gpus", "4"],
     "Ulysses degree 4 must divide the model's 2 attention heads"),
]  # fmt: skip


@pytest.mark.parametrize("family,extra,needle", REFUSED)
def test_what_a_family_cannot_do_is_one_line(family, extra, needle, folders, tmp_path):
    extra = [str(folders["image"]) if a == "IMAGE" else a for a in extra]
    args = ["check", "--model", str(folders[family]), "--prompt", "x", "--out", str(tmp_path / "o"), *extra]
    refused(CliRunner().invoke(app, args), needle)


# -- the defaults the pipelines derive ------------------------------------------------------------------


def _checked_item(folder: Path, tmp_path: Path, *extra: str) -> dict:
    result = CliRunner().invoke(
        app, ["check", "--model", str(folder), "--prompt", "x", "--json", "--out", str(tmp_path / "o"), *extra]
    )
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["items"][0]


def test_a_skyreels_image_to_video_folder_takes_its_pipelines_guidance(folders, tmp_path):
    """Bug: a SkyReelsV2ImageToVideoPipeline folder ran at guidance 6.0 (the text-to-video
    pipeline's) where its pipeline's default is 5.0; each folder takes the default of the
    pipeline its model_index.json names, as the named models do."""
    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline

    from runtime.models.registry import REGISTRY

    def default(cls) -> float:
        return inspect.signature(cls.__call__).parameters["guidance_scale"].default

    i2v = _checked_item(folders["skyreels-v2-i2v"], tmp_path, "--image", str(folders["image"]))
    t2v = _checked_item(folders["skyreels-v2"], tmp_path)
    assert (i2v["guidance"], t2v["guidance"]) == (default(SkyReelsV2ImageToVideoPipeline), default(SkyReelsV2Pipeline))
    assert i2v["guidance"] != t2v["guidance"]
    assert REGISTRY["skyreels-v2-i2v-14b-540p"].defaults.guidance == i2v["guidance"]
    given = _checked_item(folders["skyreels-v2-i2v"], tmp_path, "--image", str(folders["image"]), "--guidance", "3")
    assert given["guidance"] == 3.0  # a flag still wins


def test_a_hunyuan15_folders_size_is_what_its_target_size_implies(folders, tmp_path):
    """Bug: a HunyuanVideo15Pipeline folder ran at 480 x 832 (the tool's generic default), where
    the pipeline derives its size from the transformer's `target_size`: the bucket of about
    (target_size / 16)^2 latent pixels nearest 16:9. A folder whose target size is changed follows
    it; the named models' sizes are those of their target sizes."""
    from diffusers import HunyuanVideo15Pipeline

    from runtime.models.hunyuan15 import MODELS
    from runtime.models.hunyuan15.shapes import default_size

    def pipelines(folder: Path) -> tuple[int, int]:
        pipe = HunyuanVideo15Pipeline.from_pretrained(folder, local_files_only=True)
        width, height = pipe.default_aspect_ratio
        return pipe.video_processor.calculate_default_height_width(height, width, pipe.target_size)

    folder = tmp_path / "model"
    shutil.copytree(folders["hunyuanvideo-1.5"], folder)
    config_file = folder / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    for target in (config["target_size"], 96):
        config_file.write_text(json.dumps({**config, "target_size": target}))
        item = _checked_item(folder, tmp_path)
        assert (item["height"], item["width"]) == pipelines(folder), target
    assert (item["height"], item["width"]) == (64, 112)  # 96 / 16 = 6: 28 latent pixels of 36, nearest 16:9
    assert _checked_item(folder, tmp_path, "--height", "32", "--width", "48")["width"] == 48  # a flag still wins
    for model in MODELS:
        d = {k: model.defaults[k] for k in ("height", "width")}
        assert default_size(model.transformer["target_size"], Path("/nonexistent")) == d, model.name
    config_file.write_text(json.dumps({**config, "target_size": "large"}))
    result = CliRunner().invoke(app, ["check", "--model", str(folder), "--prompt", "x", "--out", str(tmp_path / "o")])
    refused(result, "target_size must be a positive int, got 'large'")


def test_hunyuan15_tiles_are_whole_quarter_overlaps(folders):
    """Bug: --vae-tile under 32 px stopped HunyuanVideo-1.5's decode ("range() arg 3 must not be
    zero"), and sides that are not 64-px multiples do not agree with diffusers' tiled_decode (its
    latent step and its pixel overlap round differently). A side is rounded down to 64 px
    multiples (64 at least), where the two agree (tests/test_vae.py holds the decode to it)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from runtime.models.hunyuan15.vae import tiling

    vae = AutoencoderKLHunyuanVideo15.from_pretrained(folders["hunyuanvideo-1.5"] / "vae")
    for px, side in ((16, 64), (48, 64), (100, 64), (128, 128), (255, 192)):
        tiles = tiling(vae, True, px)
        assert (tiles.min_px, tiles.stride_px) == (side, side * 3 // 4), px
        assert vae.tile_latent_min_height * 16 == side and vae.tile_overlap_factor == 0.25


def _hidden_states_target(rank, world, events):
    """Each text encoder's hidden states, unsharded and after FSDP2 over this one rank."""
    from planner.layout import ParallelLayout, virtual_node_map
    from runtime.mesh import build_mesh
    from runtime.weights import shard_weights
    from tiny_wan.hunyuan import build_tiny_hunyuan
    from tiny_wan.hunyuan15 import build_tiny_hunyuan15

    layout = ParallelLayout(strategy="ring")
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=60)
    out = {}
    for name, build in (("llama", build_tiny_hunyuan), ("qwen", build_tiny_hunyuan15)):
        encoder = build()["text_encoder"]
        ids = torch.arange(3, 15).unsqueeze(0)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        whole = encoder(**kwargs).hidden_states
        assert shard_weights({"text_encoder": encoder}, mesh, torch.device("cpu"), min_degree=1) == 1
        out[name] = whole, encoder(**kwargs).hidden_states, type(encoder).__name__
    return out


@pytest.mark.distributed
def test_sharded_text_encoders_keep_their_hidden_states():
    """Bug: --shard-weights on HunyuanVideo-1.5 (Qwen2.5-VL) and HunyuanVideo (Llama) failed at
    the first prompt: transformers finds which layer outputs to record by the model's class
    name, FSDP2 renames the class (FSDP<Name>), and `hidden_states` came back None; both
    pipelines read a hidden state before the last."""
    from slurm.launchers.processes import run_ranks

    (found,) = run_ranks(_hidden_states_target, 1, (), timeout_s=120)
    for name, (whole, sharded, cls) in found.items():
        assert cls.startswith("FSDP") and sharded is not None, (name, cls)
        assert len(sharded) == len(whole) > 2, name
        assert all(torch.equal(a, b) for a, b in zip(whole, sharded, strict=True)), name
