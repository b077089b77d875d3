"""HunyuanVideo: our loop against diffusers' HunyuanVideoPipeline, and joint text-video attention
under every strategy against one process, on a tiny random model (tiny_wan/hunyuan.py)."""

from __future__ import annotations

import pytest
import torch

from planner.ditango import DiTangoOptions, PlannerConfig
from planner.layout import ParallelLayout, chunk_sizes, virtual_node_map
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from slurm.launchers.processes import run_ranks
from tiny_wan.hunyuan import build_tiny_hunyuan, prompt_template

TEXT_LEN = 24
STEPS = 4
TIMEOUT_S = 120
PROMPT, NEGATIVE = "a red square moving left", "blurry"
SIZES = {
    4: dict(height=48, width=80, frames=5),  # 2 x 3 x 5 = 30 video tokens: 8, 8, 7, 7
    3: dict(height=32, width=80, frames=5),  # 2 x 2 x 5 = 20: 7, 7, 6
    2: dict(height=48, width=80, frames=9),  # 3 x 3 x 5 = 45: 23, 22
}


def denoiser(components: dict | None = None, **parallel) -> Denoiser:
    components = components or build_tiny_hunyuan()
    template = prompt_template(components["tokenizer"])
    return build_denoiser(components, resolve_placement("cpu"), TEXT_LEN, prompt_template=template, **parallel)


def ours(den: Denoiser, size: dict, true_cfg: float = 1.0, embedded: float = 6.0) -> torch.Tensor:
    text = den.encode_text(PROMPT, NEGATIVE if true_cfg > 1 else None, true_cfg, embedded)
    x = den.initial_latents(3, size["height"], size["width"], size["frames"])
    return den.denoise(x, text, STEPS, true_cfg).latents_BCFHW


def diffusers_latents(size: dict, true_cfg: float = 1.0, embedded: float = 6.0) -> torch.Tensor:
    from diffusers import HunyuanVideoPipeline

    components = build_tiny_hunyuan()
    pipe = HunyuanVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE if true_cfg > 1 else None,
        true_cfg_scale=true_cfg,
        guidance_scale=embedded,
        num_inference_steps=STEPS,
        height=size["height"],
        width=size["width"],
        num_frames=size["frames"],
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
        max_sequence_length=TEXT_LEN,
        prompt_template=prompt_template(components["tokenizer"]),
    ).frames


@pytest.mark.parametrize("true_cfg", [1.0, 4.0])
def test_one_process_equals_the_pipeline(true_cfg):
    got = ours(denoiser(), SIZES[4], true_cfg)
    want = diffusers_latents(SIZES[4], true_cfg)
    assert got.shape == want.shape and bool(torch.isfinite(got).all())
    assert (got - want).abs().max().item() <= 1e-5


def test_the_adapter_on_one_rank_equals_the_pipeline():
    """Dropped text padding and our joint-attention processor, without any peer: diffusers' numbers."""
    mesh = build_mesh(ParallelLayout(strategy="ring"), 0, (0,))
    got = ours(denoiser(mesh=mesh, comm=Comm(mesh)), SIZES[4], 4.0)
    assert (got - diffusers_latents(SIZES[4], 4.0)).abs().max().item() <= 1e-5


def _target(rank, world, events, runs):
    components = build_tiny_hunyuan()
    out = {}
    for name, kwargs, opts, true_cfg in runs:
        if kwargs is None:  # this process alone: the sequential loop with this rank's threads
            out[name] = (ours(denoiser(components), SIZES[world], true_cfg), None, None, [])
            continue
        layout = ParallelLayout(nodes=2 if world == 4 else 1, gpus_per_node=world // (2 if world == 4 else 1), **kwargs)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(mesh)
        den = denoiser(components, mesh=mesh, comm=comm, ditango=opts)
        texts = []  # the text stream after the last block, every forward: must agree across ranks
        hook = den.transformer.single_transformer_blocks[-1].register_forward_hook(
            lambda module, args, output, texts=texts: texts.append(output[1].clone())
        )
        latents = ours(den, SIZES[world], true_cfg)
        hook.remove()
        report = None if den.ditango is None else den.ditango.item_report()
        if den.parallel is not None:
            den.parallel.remove()
        out[name] = (latents, comm.totals(), report, texts)
    return out


DITANGO = {"strategy": "ditango", "group_size": 2}
RUNS = {
    4: [
        ("ring", {"strategy": "ring"}, None, 1.0),
        ("usp", {"strategy": "usp", "ulysses_degree": 2}, None, 1.0),
        ("ratio0", DITANGO, DiTangoOptions(PlannerConfig(cache_ratio=0.0, warmup=1, cooldown=0)), 1.0),
        ("reuse", DITANGO, DiTangoOptions(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=0)), 1.0),
        ("cfg_ring", {"strategy": "ring", "cfg_degree": 2}, None, 4.0),
    ],
    3: [("ring", {"strategy": "ring"}, None, 1.0)],
    2: [
        ("ring", {"strategy": "ring"}, None, 1.0),
        ("ulysses", {"strategy": "ulysses"}, None, 1.0),
        ("cfg", {"strategy": "none", "cfg_degree": 2}, None, 4.0),
        ("sequential", None, None, 4.0),
    ],
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.sweep)])
def test_strategies_equal_one_process(world):
    size = SIZES[world]
    tokens = ((size["frames"] - 1) // 4 + 1) * (size["height"] // 16) * (size["width"] // 16)  # 8x VAE, 2x2 patch
    assert len(set(chunk_sizes(tokens, world))) == 2, tokens  # video tokens uneven over the ranks
    per_rank = run_ranks(_target, world, (RUNS[world],), timeout_s=600)
    refs = {cfg: ours(denoiser(), size, cfg) for cfg in (1.0, 4.0)}
    for name, kwargs, _, true_cfg in RUNS[world]:
        for rank in range(world):
            latents = per_rank[rank][name][0]
            assert torch.equal(latents, per_rank[0][name][0]), (name, rank)  # every rank steps alike
            if kwargs and kwargs.get("cfg_degree", 1) == 1:  # one branch per rank otherwise
                texts = per_rank[rank][name][3]  # text rows: bit-identical on every rank, every forward
                assert len(texts) == len(per_rank[0][name][3]) > 0
                assert all(torch.equal(a, b) for a, b in zip(texts, per_rank[0][name][3], strict=True)), (name, rank)
            if name != "reuse":  # DiTango with reuse is approximate by design
                err = (latents - refs[true_cfg]).abs().max().item()
                assert err <= 1e-4, (name, rank, err)
    # The cost model's byte counts (planner/traffic.py) equal the runtime's, text rows included.
    from planner.models import VideoSize
    from planner.traffic import predict_traffic
    from runtime.item_records import sum_comm
    from runtime.models.hunyuan import shape_of

    den = denoiser()
    text_len = int(den.encode_text(PROMPT, None, 1.0).cond_BLE.inputs["encoder_attention_mask"].sum())
    shape = shape_of("tiny", dict(den.transformer.config), 0, text_len, (4, 8, 8))
    for name, kwargs, _, true_cfg in RUNS[world]:
        if kwargs is None or true_cfg > 1 or kwargs["strategy"] not in ("ring", "ulysses", "usp"):
            continue
        nodes = 2 if world == 4 else 1
        layout = ParallelLayout(nodes=nodes, gpus_per_node=world // nodes, **kwargs)
        want = predict_traffic(layout, shape, VideoSize(**size), STEPS, guidance=False, element_bytes=4)
        got = sum_comm([per_rank[r][name][1] for r in range(world)])
        assert got == want, (name, got, want)
        assert got["by_purpose"]["joint"], name
    if world == 2:  # true CFG on two ranks runs each branch as one process does
        for rank in range(2):
            cfg, sequential = per_rank[rank]["cfg"][0], per_rank[rank]["sequential"][0]
            assert (cfg - sequential).abs().max().item() <= 1e-6
    if world == 4:
        ring, exact = per_rank[0]["ring"][0], per_rank[0]["ratio0"][0]
        assert (ring - exact).abs().max().item() <= 1e-4  # DiTango at cache ratio 0 is ring
        inter = {n: sum(per_rank[r][n][1]["inter_node_bytes"] for r in range(4)) for n in ("ring", "ratio0", "reuse")}
        assert inter["reuse"] < min(inter["ring"], inter["ratio0"]), inter
        reports = [per_rank[r]["reuse"][2] for r in range(4)]
        assert reports[0]["computed_fraction_all_steps"] < 1.0
        assert len({r["plan_hash"] for r in reports}) == 1  # one plan on every rank


def test_a_hunyuanvideo_directory_from_the_command_line(runner, tmp_path):
    """Saved HunyuanVideoPipeline directory -> `ditango generate` (true CFG, embedded guidance)
    gives the pipeline's latents; CFG-parallel without true CFG, and Hybridiff's first segment on
    the negative text, are refused."""
    from diffusers import HunyuanVideoPipeline
    from safetensors.torch import load_file

    from ditango_cli.app import app

    model = tmp_path / "hunyuan"
    HunyuanVideoPipeline(**build_tiny_hunyuan()).save_pretrained(model, safe_serialization=True)
    size = SIZES[4]
    common = [
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--steps",
        "2",
        "--height",
        str(size["height"]),
        "--width",
        str(size["width"]),
        "--frames",
        str(size["frames"]),
        "--device",
        "cpu",
        "--seed",
        "3",
    ]
    out = tmp_path / "out"
    args = [
        "generate",
        *common,
        "--negative-prompt",
        NEGATIVE,
        "--guidance",
        "5",
        "--true-cfg-scale",
        "3",
        "--out",
        str(out),
        "--save-latents",
        "--quiet",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    (latents_file,) = out.glob("*.latents.safetensors")
    got = next(iter(load_file(latents_file).values()))
    pipe = HunyuanVideoPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        true_cfg_scale=3.0,
        guidance_scale=5.0,
        num_inference_steps=2,
        height=size["height"],
        width=size["width"],
        num_frames=size["frames"],
        output_type="latent",
        generator=torch.Generator("cpu").manual_seed(3),
    ).frames
    assert (got - want).abs().max().item() <= 1e-5
    assert list(out.glob("*.mp4"))
    for extra, needle in (
        (["--nodes", "1", "--gpus", "2", "--cfg-parallel", "--executor", "local"], "needs --true-cfg-scale > 1"),
        (
            [
                "--nodes",
                "1",
                "--gpus",
                "2",
                "--cfg-parallel",
                "--hybrid",
                "--hybrid-first-text",
                "uncond",
                "--true-cfg-scale",
                "3",
                "--executor",
                "local",
            ],
            "--hybrid-first-text uncond does not apply",
        ),
    ):
        result = runner.invoke(app, ["check", *common, "--out", str(tmp_path / "o2"), *extra])
        assert result.exit_code == 2 and needle in result.stderr, result.stderr
    wan = runner.invoke(app, ["check", "--prompt", "x", "--out", str(tmp_path / "o3"), "--true-cfg-scale", "2"])
    assert wan.exit_code == 2 and "apply to HunyuanVideo only" in wan.stderr, wan.stderr


def _hybrid_target(rank, world, events, k):
    from planner.hybrid import HybridConfig
    from runtime.guidance import Hybrid

    den = denoiser()
    layout = ParallelLayout(nodes=1, gpus_per_node=2, strategy="none", cfg_degree=2)
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    den.guidance = Hybrid(mesh, Comm(mesh), HybridConfig(k=k, tau_cap=1), den.transformers)
    latents = ours(den, SIZES[4], 4.0)
    return latents, den.guidance.record()


@pytest.mark.distributed
def test_hybridiff_cuts_both_block_stacks():
    """Hybridiff on HunyuanVideo (true CFG): the pipeline window runs segment A (dual-stream
    blocks) and segment B (single-stream blocks) on the boundary's video and text streams;
    with k = 0 it is CFG-parallel, exact."""
    (a, record), (b, record_b) = run_ranks(_hybrid_target, 2, (2,), timeout_s=300)
    assert record["stages"] == record_b["stages"] == ["cfg-parallel", "cfg-parallel", "pipeline-fill", "pipeline"]
    blocks = 4  # 2 dual + 2 single; the cut in the middle: segment A = the dual-stream blocks
    assert record["block_evals"] == [blocks, blocks, 0, 2] and record_b["block_evals"] == [blocks, blocks, blocks, 2]
    assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    ref = ours(denoiser(), SIZES[4], 4.0)
    rel = ((a - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.5, rel  # two of four steps approximate, not garbage
    (exact, _), _ = run_ranks(_hybrid_target, 2, (0,), timeout_s=300)
    assert (exact - ref).abs().max().item() <= 1e-4
