"""Wan2.2 (two-expert A14B, TI2V-5B) and image-to-video (Wan2.1 I2V, Wan2.2 I2V): our loop
against diffusers' own pipelines, and every strategy against one process, on tiny random
models of each family (tiny_wan.build)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from planner.ditango import DiTangoOptions, PlannerConfig
from planner.layout import ParallelLayout, virtual_node_map
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from runtime.models.wan import WanVariant
from slurm.launchers.processes import run_ranks
from tiny_wan import TinyWanConfig, build_tiny_wan
from tiny_wan.build import pipeline_kwargs

TEXT_LEN = 16
TIMEOUT_S = 120
STEPS = 6
GEN = dict(prompt="a red square moving left", negative="blurry", seed=7, guidance=4.0, guidance_2=2.5)
# 4 heads: Ulysses 4 and USP 2x2 are legal. Latents 2 x 6 x 10 -> 30 tokens, uneven over 4 ranks.
BASE = dict(heads=4, head_dim=8, layers=2, ffn_dim=32, text_dim=24, text_heads=2, max_text_len=TEXT_LEN)
FAMILIES = {
    "t2v-a14b": (TinyWanConfig(seed=31, experts=2, boundary_ratio=0.75, **BASE), False),
    "ti2v-5b": (TinyWanConfig(seed=32, expand_timesteps=True, vae22=True, **BASE), False),
    "ti2v-5b-image": (TinyWanConfig(seed=32, expand_timesteps=True, vae22=True, **BASE), True),
    "i2v-wan2.1": (TinyWanConfig(seed=33, image="clip", **BASE), True),
    "i2v-a14b": (TinyWanConfig(seed=34, image="latent", experts=2, boundary_ratio=0.75, **BASE), True),
}


def size(cfg: TinyWanConfig) -> dict:
    stride = 16 if cfg.vae22 else 8
    return dict(height=6 * stride, width=10 * stride, frames=5)


def variant(cfg: TinyWanConfig) -> WanVariant:
    return WanVariant(
        pipeline="WanPipeline" if cfg.image == "none" else "WanImageToVideoPipeline",
        boundary_ratio=cfg.boundary_ratio,
        expand_timesteps=cfg.expand_timesteps,
        image_encoder=cfg.image == "clip",
    )


def test_image() -> Image.Image:
    """Not the video's aspect ratio: the pipelines resize it."""
    pixels = np.random.default_rng(3).integers(0, 256, size=(40, 72, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


test_image.__test__ = False  # a helper, not a test


def ours(den: Denoiser, cfg: TinyWanConfig, with_image: bool, steps: int = STEPS, s: dict | None = None):
    s = s or size(cfg)
    text = den.encode_text(GEN["prompt"], GEN["negative"], GEN["guidance"])
    x = den.initial_latents(GEN["seed"], s["height"], s["width"], s["frames"])
    cond = den.encode_image(test_image(), x, s["height"], s["width"], s["frames"]) if with_image else None
    g2 = GEN["guidance_2"] if cfg.experts == 2 else None
    return den.denoise(x, text, steps, GEN["guidance"], condition=cond, guidance_2=g2).latents_BCFHW


def diffusers_latents(cfg: TinyWanConfig, with_image: bool) -> torch.Tensor:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    components = build_tiny_wan(cfg)
    cls = WanImageToVideoPipeline if with_image else WanPipeline
    pipe = cls(**components, **pipeline_kwargs(cfg))
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(
        prompt=GEN["prompt"],
        negative_prompt=GEN["negative"],
        num_inference_steps=STEPS,
        guidance_scale=GEN["guidance"],
        generator=torch.Generator("cpu").manual_seed(GEN["seed"]),
        output_type="latent",
        max_sequence_length=TEXT_LEN,
        **{"num_frames" if k == "frames" else k: v for k, v in size(cfg).items()},
    )
    if cfg.experts == 2:
        kwargs["guidance_scale_2"] = GEN["guidance_2"]
    if with_image:
        kwargs["image"] = test_image()
    return pipe(**kwargs).frames


@pytest.fixture(scope="module")
def references() -> dict:
    return {
        name: ours(Denoiser(build_tiny_wan(cfg), resolve_placement("cpu"), TEXT_LEN, variant(cfg)), cfg, image)
        for name, (cfg, image) in FAMILIES.items()
    }


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_process_equals_diffusers_pipeline(name, references):
    cfg, with_image = FAMILIES[name]
    want = diffusers_latents(cfg, with_image)
    got = references[name]
    assert got.shape == want.shape and bool(torch.isfinite(got).all())
    err = (got - want).abs().max().item()
    assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("name", ["t2v-a14b", "i2v-a14b"])
def test_both_experts_run_and_the_switch_is_mid_run(name, references):
    """The old silent failure: the second expert ignored. Here it must take the low-noise steps,
    and the latents must differ from a run that keeps the first expert throughout."""
    cfg, with_image = FAMILIES[name]
    components = build_tiny_wan(cfg)
    den = Denoiser(components, resolve_placement("cpu"), TEXT_LEN, variant(cfg))
    switches = den.switches(den.new_scheduler(STEPS))
    assert len(switches) == 1 and 0 < switches[0] < STEPS, switches
    one = Denoiser(components, resolve_placement("cpu"), TEXT_LEN, WanVariant(pipeline=variant(cfg).pipeline))
    single = ours(one, cfg, with_image)
    assert (single - references[name]).abs().max().item() > 1e-3


def _target(rank, world, events, names):
    out = {}
    for name in names:
        cfg, with_image = FAMILIES[name]
        components = build_tiny_wan(cfg)
        ditango = {"strategy": "ditango", "group_size": 2}
        runs = [
            ("ring", {"strategy": "ring"}, None),
            ("ulysses", {"strategy": "ulysses"}, None),
            ("usp", {"strategy": "usp", "ulysses_degree": 2}, None),
            ("ratio0", ditango, DiTangoOptions(PlannerConfig(cache_ratio=0.0, warmup=1, cooldown=0))),
            ("reuse", ditango, DiTangoOptions(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=0))),
            ("cfg", {"strategy": "ring", "cfg_degree": 2}, None),
        ]
        for run, kwargs, opts in runs:
            layout = ParallelLayout(nodes=2, gpus_per_node=world // 2, **kwargs)
            mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
            comm = Comm(mesh)
            den = build_denoiser(
                components, resolve_placement("cpu"), TEXT_LEN, variant=variant(cfg), mesh=mesh, comm=comm, ditango=opts
            )
            latents = ours(den, cfg, with_image)
            report = None if den.ditango is None else den.ditango.item_report()
            den.parallel.remove()
            out[(name, run)] = (latents, comm.totals(), report)
    return out


def small_size(cfg: TinyWanConfig, world: int) -> dict:
    """Token counts uneven over `world` ranks: 3 x 3 x 5 = 45 over 2, 2 x 2 x 5 = 20 over 3."""
    stride = 16 if cfg.vae22 else 8
    return dict(height=(6 if world == 2 else 4) * stride, width=10 * stride, frames=9 if world == 2 else 5)


def _small_target(rank, world, events, names):
    out = {}
    for name in names:
        cfg, with_image = FAMILIES[name]
        components = build_tiny_wan(cfg)
        den = Denoiser(components, resolve_placement("cpu"), TEXT_LEN, variant(cfg))
        strategies = ("ring", "ulysses") if world == 2 else ("ring",)  # 4 heads: no Ulysses 3
        out[(name, None)] = ours(den, cfg, with_image, s=small_size(cfg, world))  # in-process reference
        for strategy in strategies:
            layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy=strategy)
            mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
            den = build_denoiser(
                components, resolve_placement("cpu"), TEXT_LEN, variant=variant(cfg), mesh=mesh, comm=Comm(mesh)
            )
            out[(name, strategy)] = ours(den, cfg, with_image, s=small_size(cfg, world))
            den.parallel.remove()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_strategies_on_two_and_three_ranks_equal_one_process(world):
    from planner.layout import chunk_sizes, token_count

    for cfg, _ in FAMILIES.values():
        s = small_size(cfg, world)
        stride = 16 if cfg.vae22 else 8
        tokens = token_count(((s["frames"] - 1) // 4 + 1, s["height"] // stride, s["width"] // stride), (1, 2, 2))
        assert len(set(chunk_sizes(tokens, world))) == 2, tokens  # uneven chunks
    per_rank = run_ranks(_small_target, world, (list(FAMILIES),), timeout_s=600)
    for name, strategy in per_rank[0]:
        if strategy is None:
            continue
        for rank in range(world):
            err = (per_rank[rank][(name, strategy)] - per_rank[rank][(name, None)]).abs().max().item()
            assert err <= 1e-4, (name, strategy, rank, err)


def _cfg_target(rank, world, events, names):
    """CFG-parallel alone (one branch per rank, no context parallelism)."""
    out = {}
    for name in names:
        cfg, with_image = FAMILIES[name]
        components = build_tiny_wan(cfg)
        layout = ParallelLayout(nodes=1, gpus_per_node=2, strategy="none", cfg_degree=2)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        # one process's loop, in this process (same threads)
        sequential = ours(Denoiser(components, resolve_placement("cpu"), TEXT_LEN, variant(cfg)), cfg, with_image)
        den = build_denoiser(
            components, resolve_placement("cpu"), TEXT_LEN, variant=variant(cfg), mesh=mesh, comm=Comm(mesh)
        )
        out[name] = (ours(den, cfg, with_image), sequential)
    return out


@pytest.fixture(scope="module")
def distributed() -> dict:
    return run_ranks(_target, 4, (list(FAMILIES),), timeout_s=600)


@pytest.mark.distributed
def test_cfg_parallel_is_exact(references):
    """One branch per rank runs the same operations as the sequential loop in the same process:
    equal to float32 rounding. (Against the main process, whose thread count differs, the
    matmuls' reduction order may move the last bits: 1e-4 there, as for the cp strategies.)"""
    per_rank = run_ranks(_cfg_target, 2, (list(FAMILIES),), timeout_s=300)
    for name, ref in references.items():
        for rank in range(2):
            parallel, sequential = per_rank[rank][name]
            err = (parallel - sequential).abs().max().item()
            assert err <= 1e-6, (name, rank, err)
            assert (parallel - ref).abs().max().item() <= 1e-4, name


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("name", list(FAMILIES))
def test_strategies_on_four_ranks_equal_one_process(name, references, distributed):
    ref = references[name]
    for run in ("ring", "ulysses", "usp", "ratio0", "cfg"):
        for rank in range(4):
            latents = distributed[rank][(name, run)][0]
            err = (latents - ref).abs().max().item()
            assert err <= 1e-4, (name, run, rank, err)
    for rank in range(4):  # DiTango at cache ratio 0 is ring
        ring, exact = distributed[rank][(name, "ring")][0], distributed[rank][(name, "ratio0")][0]
        assert (ring - exact).abs().max().item() <= 1e-4
    # DiTango with reuse moves fewer bytes across nodes than ring and than itself exact.
    ring_bytes = sum(distributed[r][(name, "ring")][1]["inter_node_bytes"] for r in range(4))
    exact_bytes = sum(distributed[r][(name, "ratio0")][1]["inter_node_bytes"] for r in range(4))
    reuse_bytes = sum(distributed[r][(name, "reuse")][1]["inter_node_bytes"] for r in range(4))
    assert ring_bytes > 0 and exact_bytes > 0
    assert reuse_bytes < min(ring_bytes, exact_bytes), (reuse_bytes, ring_bytes, exact_bytes)
    report = distributed[0][(name, "reuse")][2]
    assert report["plan"]["computed_fraction_all_steps"] < 1.0
    cfg, _ = FAMILIES[name]
    if cfg.experts == 2:
        # Nothing cached crosses the expert switch: the switch step is an anchor, and shown.
        switches = report["plan"]["expert_switches"]
        assert len(switches) == 1, switches
        assert report["plan"]["kinds"][switches[0]] == "anchor"
    else:
        assert report["plan"]["expert_switches"] == []


def _save(cfg: TinyWanConfig, path, image_pipeline: bool):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    cls = WanImageToVideoPipeline if image_pipeline else WanPipeline
    cls(**build_tiny_wan(cfg), **pipeline_kwargs(cfg)).save_pretrained(path, safe_serialization=True)
    return path


def test_a_two_expert_directory_runs_both_experts_from_the_command_line(runner, tmp_path):
    """The old silent failure, end to end: a Wan2.2 A14B directory generated through the CLI
    gives diffusers' two-expert latents (--guidance-2 honoured), not one expert's."""
    from safetensors.torch import load_file

    from ditango_cli.app import app

    cfg, _ = FAMILIES["t2v-a14b"]
    model = _save(cfg, tmp_path / "a14b", False)
    s = size(cfg)
    args = [
        "generate",
        "--model",
        str(model),
        "--prompt",
        GEN["prompt"],
        "--negative-prompt",
        GEN["negative"],
        "--seed",
        str(GEN["seed"]),
        "--steps",
        str(STEPS),
        "--guidance",
        str(GEN["guidance"]),
        "--guidance-2",
        str(GEN["guidance_2"]),
        "--height",
        str(s["height"]),
        "--width",
        str(s["width"]),
        "--frames",
        str(s["frames"]),
        "--out",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--save-latents",
        "--quiet",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    (latents_file,) = (tmp_path / "out").glob("*.latents.safetensors")
    got = next(iter(load_file(latents_file).values()))
    # The CLI reads the text length from the model directory's defaults (512): diffusers alike.
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt=GEN["prompt"],
        negative_prompt=GEN["negative"],
        num_inference_steps=STEPS,
        guidance_scale=GEN["guidance"],
        guidance_scale_2=GEN["guidance_2"],
        output_type="latent",
        generator=torch.Generator("cpu").manual_seed(GEN["seed"]),
        num_frames=s["frames"],
        height=s["height"],
        width=s["width"],
    ).frames
    assert (got - want).abs().max().item() <= 1e-5


def test_image_to_video_from_a_prompt_file(runner, tmp_path):
    """An I2V directory with a JSONL prompt file whose images are relative to the file; a
    missing image is one line, exit 2, before anything loads."""
    from ditango_cli.app import app

    cfg, _ = FAMILIES["i2v-wan2.1"]
    model = _save(cfg, tmp_path / "i2v", True)
    s = size(cfg)
    (tmp_path / "batch" / "frames").mkdir(parents=True)
    test_image().save(tmp_path / "batch" / "frames" / "first.png")
    prompts = tmp_path / "batch" / "batch.jsonl"
    prompts.write_text('{"id": "cat", "prompt": "a red square", "image": "frames/first.png"}\n')
    common = [
        "--model",
        str(model),
        "--steps",
        "2",
        "--height",
        str(s["height"]),
        "--width",
        str(s["width"]),
        "--frames",
        str(s["frames"]),
        "--out",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--quiet",
    ]
    result = runner.invoke(app, ["generate", "--prompts", str(prompts), *common])
    assert result.exit_code == 0, result.stderr
    record = json.loads((tmp_path / "out" / "cat.json").read_text())
    assert record["status"] == "done" and record["image"] == str(tmp_path / "batch" / "frames" / "first.png")
    assert (tmp_path / "out" / "cat.mp4").stat().st_size > 0
    for bad, needle in (("missing.png", "not found"), ("batch.jsonl", "cannot be read as an image")):
        prompts.write_text(f'{{"id": "x", "prompt": "a red square", "image": "{bad}"}}\n')
        result = runner.invoke(
            app,
            ["generate", "--prompts", str(prompts), *common[:-5], "--out", str(tmp_path / "out2"), "--device", "cpu"],
        )
        assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = runner.invoke(app, ["generate", "--prompt", "a red square", *common])
    assert result.exit_code == 2 and "is image-to-video" in result.stderr, result.stderr


def _hybrid_target(rank, world, events):
    from planner.hybrid import HybridConfig

    cfg, with_image = FAMILIES["t2v-a14b"]
    layout = ParallelLayout(nodes=1, gpus_per_node=2, strategy="none", cfg_degree=2)
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    # tau_cap 1: tau1 = 1, so the pipeline window is steps 2..5 and spans the switch at step 4.
    den = build_denoiser(
        build_tiny_wan(cfg),
        resolve_placement("cpu"),
        TEXT_LEN,
        variant=variant(cfg),
        mesh=mesh,
        comm=Comm(mesh),
        hybrid=HybridConfig(k=4, tau_cap=1),
    )
    latents = ours(den, cfg, with_image)
    return latents, den.guidance.record(), den.switches(den.new_scheduler(STEPS))


@pytest.mark.distributed
def test_hybrid_never_feeds_one_experts_boundary_to_the_other():
    """Hybridiff over a two-expert model: the first pipeline step of the second expert is a
    fill (the new expert runs both segments), not segment B on the old expert's boundary."""
    per_rank = run_ranks(_hybrid_target, 2, (), timeout_s=300)
    (a, record, switches), (b, record_b, _) = per_rank
    assert switches == (4,)
    stages = ["cfg-parallel", "cfg-parallel", "pipeline-fill", "pipeline", "pipeline-fill", "pipeline"]
    assert record["stages"] == record_b["stages"] == stages
    layers = BASE["layers"]
    assert record_b["block_evals"][4] == layers and record["block_evals"][4] == 0  # cfg-1 runs it whole
    assert torch.equal(a, b) and bool(torch.isfinite(a).all())
