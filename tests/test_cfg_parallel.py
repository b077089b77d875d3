"""CFG-parallel and Hybridiff across processes (gloo): parity with the 1-process CFG
latents, alone and composed with ring/Ulysses/DiTango; k = 0 equals CFG-parallel; the
pipeline window's block-evaluation accounting."""

from __future__ import annotations

import pytest
import torch

from planner.ditango import DiTangoOptions, PlannerConfig
from planner.hybrid import HybridConfig
from planner.layout import ParallelLayout, virtual_node_map
from planner.strategy import strategy_named
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from slurm.launchers.processes import run_ranks
from tests.test_cp_pipeline import CP_MODEL, TEXT_LEN
from tiny_wan import build_tiny_wan

pytestmark = pytest.mark.distributed  # every test here runs several ranks

LATENT_ATOL = 1e-4
TIMEOUT_S = 90
STEPS = 8


def generate(denoiser: Denoiser) -> torch.Tensor:
    text = denoiser.encode_text("a yellow circle moving down", "blurry", 4.0)
    x = denoiser.initial_latents(5, 48, 80, 5)
    return denoiser.denoise(x, text, STEPS, 4.0).latents_BCFHW


def _target(rank, world, events, runs):
    components = build_tiny_wan(CP_MODEL)
    out = {}
    for name, strategy, hybrid, ditango in runs:
        group = 1 if strategy_named(strategy).reuses else None  # 2 cp ranks, 2 groups: one remote unit to plan
        layout = ParallelLayout(nodes=2, gpus_per_node=world // 2, cfg_degree=2, strategy=strategy, group_size=group)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(mesh)
        denoiser = build_denoiser(
            components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm, ditango=ditango, hybrid=hybrid
        )
        runner = denoiser.guidance
        if name.endswith("_bf16"):  # last run of a list: the model stays in bf16 afterwards
            denoiser.transformer.to(torch.bfloat16)
        latents = generate(denoiser)
        record = runner.record()
        if hybrid:
            runner.counter.remove()
        plan = None
        if denoiser.ditango:
            report = denoiser.ditango.item_report()
            plan = (report["plan_hash"], report["computed_fraction_all_steps"])
        if denoiser.parallel:
            denoiser.parallel.remove()
        out[name] = (latents, comm.totals(), record, plan)
    return out


@pytest.fixture(scope="module")
def reference():
    return generate(Denoiser(build_tiny_wan(CP_MODEL), resolve_placement("cpu"), TEXT_LEN))


HYB = dict(window=2, slope=10.0, tau_cap=2)  # tau1 = 2 (the cap; the rule starts at i = L = 2): pipeline from step 3


@pytest.fixture(scope="module")
def two_ranks():
    runs = [
        ("cfg", "none", None, None),
        ("k0", "none", HybridConfig(k=0, **HYB), None),
        ("k3", "none", HybridConfig(k=3, **HYB), None),
        ("k3_uncond", "none", HybridConfig(k=3, first_segment_text="uncond", **HYB), None),
        ("k3_bf16", "none", HybridConfig(k=3, **HYB), None),
    ]
    return run_ranks(_target, 2, (runs,), timeout_s=TIMEOUT_S)


def test_cfg_parallel_matches_one_process(two_ranks, reference):
    for rank in range(2):
        latents, totals, _, _ = two_ranks[rank]["cfg"]
        assert (latents - reference).abs().max().item() <= LATENT_ATOL
        # Only the predictions cross (one per step each way), and the two nodes are the two branches.
        assert totals["by_purpose"] == {"cfg": {"inter_node_bytes": STEPS * reference.numel() * 4}}


def test_hybrid_k0_is_cfg_parallel(two_ranks):
    for rank in range(2):
        assert torch.equal(two_ranks[rank]["k0"][0], two_ranks[rank]["cfg"][0])
        record = two_ranks[rank]["k0"][2]
        assert set(record["stages"]) == {"cfg-parallel"} and record["tau1"] is not None


def test_hybrid_pipeline_window_and_block_accounting(two_ranks):
    layers, split = CP_MODEL.layers, CP_MODEL.layers // 2
    for name in ("k3", "k3_uncond"):
        records = [two_ranks[r][name][2] for r in range(2)]
        assert records[0]["stages"] == records[1]["stages"]
        r = records[0]
        tau1 = r["tau1"]
        assert (tau1, r["tau2"]) == (2, 5)
        expected_stages = ["cfg-parallel"] * (tau1 + 1) + ["pipeline-fill"] + ["pipeline"] * 2
        assert r["stages"] == expected_stages + ["cfg-parallel"] * (STEPS - len(expected_stages))
        # Expected block evaluations per step: cfg-parallel L on each rank; fill: the cfg-1 rank
        # runs the whole model, the cfg-0 rank nothing; pipeline: split and L - split.
        expected = {"cfg-parallel": (layers, layers), "pipeline-fill": (0, layers), "pipeline": (split, layers - split)}
        # The schedule's semantics, computed in one process by a different mechanism.
        ref = hybrid_reference("uncond" if name.endswith("uncond") else "cond", k=3, tau1=tau1)
        assert (two_ranks[0][name][0] - ref).abs().max().item() <= LATENT_ATOL, name
        for rank in range(2):
            assert records[rank]["block_evals"] == [expected[s][rank] for s in r["stages"]]
        assert [m is None for m in r["rel_mae"]] == [s != "cfg-parallel" for s in r["stages"]]
        a, b = two_ranks[0][name][0], two_ranks[1][name][0]
        assert torch.equal(a, b) and torch.isfinite(a).all()
    # The first segment's text matters (it changes the boundary activations).
    assert not torch.equal(two_ranks[0]["k3"][0], two_ranks[0]["k3_uncond"][0])


def test_hybrid_in_bf16_keeps_ranks_identical(two_ranks):
    """Guards a dtype bug: the fill step received a bf16 prediction into a float32 buffer."""
    a, b = two_ranks[0]["k3_bf16"][0], two_ranks[1]["k3_bf16"][0]
    assert torch.equal(a, b) and torch.isfinite(a).all()
    assert ((a - two_ranks[0]["k3"][0]).norm() / two_ranks[0]["k3"][0].norm()).item() < 0.05


def hybrid_reference(first_text: str, k: int, tau1: int) -> torch.Tensor:
    """Hybridiff in one process without the runtime's segment machinery: full forwards with
    a hook that records segment A's output and a pre-hook that feeds segment B a boundary."""
    den = Denoiser(build_tiny_wan(CP_MODEL), resolve_placement("cpu"), TEXT_LEN)
    blocks, split = den.transformer.blocks, CP_MODEL.layers // 2
    text = den.encode_text("a yellow circle moving down", "blurry", 4.0)
    first = text.cond_BLE if first_text == "cond" else text.uncond_BLE
    x = den.initial_latents(5, 48, 80, 5)
    scheduler = den.new_scheduler(STEPS)
    previous = None
    for i, t in enumerate(scheduler.timesteps):
        if i <= tau1 or i > tau1 + k:
            cond, uncond = den.predict(x, t, text.cond_BLE), den.predict(x, t, text.uncond_BLE)
            noise = uncond + 4.0 * (cond - uncond)
        else:
            seen = {}
            hook = blocks[split - 1].register_forward_hook(lambda m, a, o, s=seen: s.setdefault("h", o))
            den.predict(x, t, first)
            hook.remove()
            boundary = seen["h"] if i == tau1 + 1 else previous  # fill uses its own; later one step stale
            feed = blocks[split].register_forward_pre_hook(lambda m, a, b=boundary: (b, *a[1:]))
            noise = den.predict(x, t, text.cond_BLE)
            feed.remove()
            previous = seen["h"]
        x = scheduler.step(noise, t, x, return_dict=False)[0]
    return x


def test_cfg_parallel_composes_with_context_parallelism(reference, two_ranks):
    ditango = DiTangoOptions(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1))
    runs = [
        ("ring", "ring", None, None),
        ("ulysses", "ulysses", None, None),
        ("ditango", "ditango", None, ditango),
        ("hybrid_ring", "ring", HybridConfig(k=3, **HYB), None),
    ]
    per_rank = run_ranks(_target, 4, (runs,), timeout_s=TIMEOUT_S)
    # Hybridiff over 2 x 2 ranks: segments run context-parallel, boundaries travel chunk by chunk.
    for rank in range(4):
        latents, _, record, _ = per_rank[rank]["hybrid_ring"]
        assert record["stages"] == two_ranks[0]["k3"][2]["stages"]
        assert (latents - two_ranks[0]["k3"][0]).abs().max().item() <= LATENT_ATOL
    for rank in range(4):
        for name in ("ring", "ulysses"):
            latents = per_rank[rank][name][0]
            assert (latents - reference).abs().max().item() <= LATENT_ATOL, (name, rank)
            # cfg groups = nodes: the cp traffic stays inside a node, predictions cross.
            assert per_rank[rank][name][1]["by_purpose"]["cfg"]["inter_node_bytes"] > 0
    # DiTango: ASE averaged over the whole world, so both branches follow one plan.
    plans = {per_rank[r]["ditango"][3] for r in range(4)}
    assert len(plans) == 1
    ((_, computed),) = plans
    assert 0.0 <= computed < 1.0  # reuse happened


@pytest.mark.e2e
def test_cli_hybrid_report(runner, tmp_path):
    import json

    from ditango_cli.app import app

    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a blue square moving up",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
        "--steps",
        "10",
        "--height",
        "32",
        "--width",
        "64",
        "--frames",
        "5",
        "--gpus",
        "2",
        "--cfg-parallel",
        "--hybrid",
        "--hybrid-window",
        "2",
        "--hybrid-slope",
        "10",
        "--hybrid-k",
        "2",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["layout"]["cfg_degree"] == 2 and report["layout"]["cp_degree"] == 1
    hybrid = report["items"][0]["hybrid"]
    assert hybrid["k"] == 2 and hybrid["tau_cap"] == 8  # tau cap: the 50-step default scaled to 10 steps
    tau1 = hybrid["tau1"]
    assert tau1 is not None and tau1 <= 7 and hybrid["tau2"] == tau1 + 2
    assert hybrid["stages"][tau1 + 1 : tau1 + 3] == ["pipeline-fill", "pipeline"]
    assert len(hybrid["block_evals"]) == 2 and len(hybrid["rel_mae"]) == 10
    assert set(hybrid["bytes_per_stage"]) == {"cfg-parallel", "pipeline-fill", "pipeline"}
    assert (out / hybrid["rel_mae_png"]).stat().st_size > 0
