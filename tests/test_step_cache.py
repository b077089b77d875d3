"""Step caches (--step-cache): diffusers' hooks with cache-off settings equal the exact run; with
caching on, every rank of a branch takes the same decisions under ring, Ulysses and DiTango
(gloo, 2-4 processes), and a context-parallel run takes the decisions one process takes."""

from __future__ import annotations

import json

import pytest
import torch

from basics.errors import ConfigError
from ditango_cli.app import app
from planner.ditango import DiTangoOptions, PlannerConfig
from planner.layout import ParallelLayout, virtual_node_map
from planner.strategy import strategy_named
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from runtime.step_cache import StepCache
from runtime.step_cache_options import parse_step_cache
from slurm.launchers.processes import run_ranks
from tiny_wan import TinyWanConfig, build_tiny_wan

TIMEOUT_S = 90
LATENT_ATOL = 1e-4  # the exact strategies' bound (tests/test_cp_pipeline.py)
# 12 heads: Ulysses over 2 and 4 ranks; 4 blocks: first-block has a head, two middle blocks, a tail.
MODEL = TinyWanConfig(seed=23, heads=12, head_dim=8, layers=4, ffn_dim=48, text_dim=24, text_heads=2)
GEN = dict(prompt="a green circle moving right", negative="blurry", seed=3, steps=10, guidance=4.0)
SIZE = dict(height=48, width=80, frames=5)  # 30 tokens: uneven chunks over 4 ranks
TEXT_LEN = 16
# Ratios for magcache (made up, none exactly 1: a threshold of 0 then never skips).
RATIOS = [1.0, 1.02, 1.01, 0.99, 1.005, 0.995, 1.01, 0.98, 1.03, 0.97]
# Settings that skip on this model (some steps computed, some skipped), and settings that never skip.
ON = ["first-block:threshold=0.1", "pab:spatial_attention_block_skip_range=2", "taylorseer:cache_interval=2,"
      "taylor_factors_dtype=float32,"
      "disable_cache_before_step=2", "magcache:threshold=0.05,retention_ratio=0.2"]  # fmt: skip
OFF = ["first-block:threshold=0", "pab:spatial_attention_block_skip_range=1", "taylorseer:cache_interval=1",
       "magcache:threshold=0"]  # fmt: skip


def cache_for(text: str, comm=None, mesh=None) -> StepCache:
    group = None if mesh is None else mesh.cp_group
    ranks = () if mesh is None else tuple(mesh.cp_ranks)
    spec = parse_step_cache(text)
    return StepCache(spec, comm, group, ranks, mag_ratios=RATIOS if spec.name == "magcache" else None)


def denoise(denoiser: Denoiser) -> torch.Tensor:
    text = denoiser.encode_text(GEN["prompt"], GEN["negative"], GEN["guidance"])
    x = denoiser.initial_latents(GEN["seed"], SIZE["height"], SIZE["width"], SIZE["frames"])
    return denoiser.denoise(x, text, GEN["steps"], GEN["guidance"]).latents_BCFHW


@pytest.fixture(scope="module")
def one_process():
    """Per setting: (latents, the cache's record) on one process; and the exact latents."""
    denoiser = Denoiser(build_tiny_wan(MODEL), resolve_placement("cpu"), TEXT_LEN)
    exact = denoise(denoiser)
    out = {}
    for text in ON + OFF:
        denoiser.step_cache = cache_for(text)
        out[text] = (denoise(denoiser), denoiser.step_cache.record(MODEL.layers))
    return exact, out


def test_cache_off_settings_equal_the_exact_run(one_process):
    exact, runs = one_process
    for text in OFF:
        latents, record = runs[text]
        assert torch.equal(latents, exact), text
        assert record["block_fraction"] == 1.0 and record["attention_fraction"] == 1.0, text


def test_caching_on_skips_work_and_changes_the_result(one_process):
    """The ON settings must skip on this model, or the agreement tests below would prove nothing."""
    exact, runs = one_process
    for text in ON:
        latents, record = runs[text]
        assert record["forwards"] == 2 * GEN["steps"]
        assert min(record["block_fraction"], record["attention_fraction"]) < 1.0, text
        assert (latents - exact).abs().max() > 1e-4, text
        computed = [n for n, _ in record["per_step"]["cond"]]
        assert computed[0] == MODEL.layers and min(computed) < MODEL.layers or text.startswith("pab"), text
    fbc = runs[ON[0]][1]
    assert fbc["skipped_steps"]["cond"] and len(fbc["skipped_steps"]["cond"]) < GEN["steps"] - 1
    # diffusers' PAB keeps one state for both CFG branches: run one after the other, the
    # second would reuse the first's attention of the same step. Each branch has its own.
    pab = runs[ON[1]][1]["per_step"]
    assert pab["cond"] == pab["uncond"]


def reuses(name: str) -> bool:
    return strategy_named(name).reuses


def _ranks_target(rank, world, events, strategy, texts):
    components = build_tiny_wan(MODEL)
    layout = ParallelLayout(nodes=2, gpus_per_node=world // 2, strategy=strategy)
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    comm = Comm(mesh)
    ditango = DiTangoOptions(PlannerConfig(warmup=2, cooldown=1, cache_ratio=0.5)) if reuses(strategy) else None
    out = {}
    for text in texts:
        spec = parse_step_cache(text)
        denoiser = build_denoiser(
            components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm, ditango=ditango, step_cache=spec
        )
        if spec.name == "magcache":
            denoiser.step_cache.mag_ratios = RATIOS
        latents = denoise(denoiser)
        plan = None
        if denoiser.ditango is not None:
            report = denoiser.ditango.item_report()
            plan = (report["plan_hash"], report["plan"]["kinds"], report["plan"]["compute_map"])
        out[text] = (latents, denoiser.step_cache.record(MODEL.layers), plan)
        denoiser.parallel.remove()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "strategy"),
    [
        (2, "ring"),
        pytest.param(4, "ulysses", marks=pytest.mark.sweep),
        pytest.param(4, "ditango", marks=pytest.mark.sweep),
    ],
)
def test_every_rank_takes_the_same_decisions(one_process, world, strategy):
    """Each rank sees its own chunk: first-block's change of the first block's residual would
    differ per chunk, so ranks would skip different steps and their exchanges could not pair
    up. Agreed, every rank evaluates the same blocks and attention layers at every step; under
    the exact strategies those are one process's decisions and the latents are one process's."""
    _, runs = one_process
    texts = ON + OFF[:1] if reuses(strategy) else ON
    per_rank = run_ranks(_ranks_target, world, (strategy, texts), timeout_s=TIMEOUT_S)
    for text in texts:
        records = [per_rank[r][text][1] for r in range(world)]
        for r in range(1, world):
            assert records[r]["per_step"] == records[0]["per_step"], (text, r)
        if reuses(strategy):
            plans = [per_rank[r][text][2] for r in range(world)]
            assert all(p == plans[0] for p in plans), text
            continue
        assert records[0]["per_step"] == runs[text][1]["per_step"], text
        for r in range(world):
            err = (per_rank[r][text][0] - runs[text][0]).abs().max().item()
            assert err <= LATENT_ATOL, (text, r, err)
    if reuses(strategy):
        # A step whose blocks after the first were skipped in both branches computed no cell of
        # those layers, and the plan says so; an anchor that skipped is followed by another.
        record, (_, kinds, compute_map) = per_rank[0][ON[0]][1], per_rank[0][ON[0]][2]
        skipped = set(record["skipped_steps"]["cond"]) & set(record["skipped_steps"]["uncond"])
        assert skipped
        for step in skipped:
            assert all(f == 0 for f in compute_map[step][1:]), (step, compute_map[step])
            if kinds[step] == "anchor" and step + 1 < len(kinds):
                assert kinds[step + 1] in ("anchor", "exact"), kinds
        ran = [s for s in range(GEN["steps"]) if s not in skipped and kinds[s] != "exact"]
        assert any(any(f > 0 for f in compute_map[s][1:]) for s in ran)


def test_parse_step_cache_and_its_errors():
    spec = parse_step_cache("first-block:threshold=0.05")
    assert spec.settings == {"threshold": 0.05}
    assert parse_step_cache("pab").settings["spatial_attention_block_skip_range"] == 2
    pab = parse_step_cache("pab:spatial_attention_timestep_skip_range=100-700")
    assert pab.settings["spatial_attention_timestep_skip_range"] == (100, 700)
    assert parse_step_cache("TaylorSeer:cache-interval=3").settings == {"cache_interval": 3}
    for bad, words in [
        ("fastercache", "must be one of"),
        ("first-block:thresh=0.1", "is not key=value"),
        ("first-block:threshold=abc", "is not valid"),
        ("first-block:threshold=-1", ">= 0"),
        ("taylorseer:cache_interval=0", ">= 1"),
        ("pab:spatial_attention_timestep_skip_range=100", "is not valid"),
        ("magcache:mag_ratios=/nonexistent.json", "is not a file"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_step_cache(bad)


FAST = ["--steps", "8", "--height", "32", "--width", "64", "--frames", "5", "--device", "cpu", "--quiet"]


def test_cli_records_skips_quality_and_magcache_ratios(runner, tmp_path):
    """magcache without mag_ratios measures them on item 1 (its exact run is item 1's
    reference); the report records them, the skipped steps and the quality vs exact."""
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a red square moving left", *FAST, "--out", str(out)]
    result = runner.invoke(
        app, [*args, "--step-cache", "magcache:threshold=0.1,retention_ratio=0.2", "--reference", "exact"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    ratios = report["step_cache_calibration"]["mag_ratios"]
    assert len(ratios) == 8 and ratios[0] == 1.0 and all(0.5 < r < 2 for r in ratios)
    item = report["items"][0]
    record = item["step_cache"]
    assert record["name"] == "magcache" and record["mag_ratios"] == ratios
    assert record["skipped_steps"]["cond"] and record["block_fraction"] < 1.0
    assert item["quality"]["reference"] == "exact" and item["quality"]["latent_rel_err"] > 0
    # A relaunch of the same command takes the stored ratios (planted here), measures nothing.
    stored = out / ".ditango" / "calibration" / "magcache-report.json"
    planted = {**json.loads(stored.read_text()), "mag_ratios": [1.0] * 8}
    stored.write_text(json.dumps(planted))
    result = runner.invoke(
        app,
        [*args, "--step-cache", "magcache:threshold=0.1,retention_ratio=0.2", "--reference", "exact", "--overwrite"],
    )
    assert result.exit_code == 0, result.output
    again = json.loads((out / "report.json").read_text())
    assert again["step_cache_calibration"]["mag_ratios"] == [1.0] * 8
    assert again["items"][0]["step_cache"]["mag_ratios"] == [1.0] * 8


def test_cli_refuses_bad_step_caches_in_one_line(runner, tmp_path):
    base = ["generate", "--prompt", "x", *FAST, "--out", str(tmp_path / "o")]
    for extra, words in [
        (["--step-cache", "nope"], "--step-cache must be one of"),
        (["--step-cache", "pab", "--hybrid", "--cfg-parallel", "--gpus-per-node", "2"], "does not combine"),
    ]:
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code != 0
        assert words in result.output and "Traceback" not in result.output, result.output


def test_planner_forgets_cells_of_layers_that_did_not_run():
    """A step cache that skipped layers 1-2 on the anchor and on a selective step: the log
    counts none of their cells, their ages keep counting (tau-max recomputes them on time),
    and an anchor that missed layers is taken again at the next step."""
    from planner.ditango import DiTangoPlanner

    cfg = PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=0, tau_max=3)
    planner = DiTangoPlanner(cfg, steps=8, layers=3, units=2)
    missing = torch.tensor([False, True, True])
    assert planner.plan(0).kind == "exact"
    planner.not_run(0, torch.zeros(3, dtype=torch.bool))
    assert planner.plan(1).kind == "anchor"
    planner.not_run(1, missing)
    assert planner.plan(2).kind == "anchor"  # taken again: layers 1-2 were not measured
    planner.not_run(2, torch.zeros(3, dtype=torch.bool))
    p3 = planner.plan(3)  # the step after an anchor reuses every unit
    assert p3.kind == "selective" and not p3.compute_LU.any()
    planner.not_run(3, missing)  # as the runtime does: what ran first, then the scores
    planner.observe(3, torch.tensor([[2.0, 2.0], [2.0, 2.0], [0.0, 0.0]]), 0.0)  # epsilon 2: layers 0, 1
    p4 = planner.plan(4)
    assert p4.compute_LU[:2].all() and not p4.compute_LU[2].any()
    planner.not_run(4, missing)  # layer 1 did not run after all: its last computation stays step 2
    planner.observe(4, torch.tensor([[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]), 0.0)
    p5 = planner.plan(5)
    assert p5.compute_LU[1].all()  # age 3 at step 5: tau-max recomputes it (it scored below epsilon)
    log = planner.log().steps
    assert not log[1].compute_LU[1:].any() and log[1].compute_LU[0].all()
    assert not log[4].compute_LU[1:].any() and log[4].compute_LU[0].all()


def test_two_experts_follow_the_steps_of_the_run():
    """diffusers' TaylorSeer counts steps per expert: the second expert (Wan2.2 A14B) would
    start again at step 0 after the switch (its warm-up again, then its own interval). It
    follows the run's steps: its first step computes (nothing of it to extrapolate from),
    then the one-expert schedule goes on."""
    from runtime.models.wan import WanVariant

    two = TinyWanConfig(
        seed=7, heads=2, head_dim=12, layers=2, ffn_dim=32, text_dim=24, text_heads=2, experts=2, boundary_ratio=0.8
    )
    den = Denoiser(build_tiny_wan(two), resolve_placement("cpu"), TEXT_LEN, WanVariant(boundary_ratio=0.8))
    (switch,) = den.switches(den.new_scheduler(GEN["steps"]))
    assert 2 < switch < GEN["steps"] - 2  # mid-run
    before, interval = 2, 3
    den.step_cache = cache_for(f"taylorseer:cache_interval={interval},disable_cache_before_step={before}")
    denoise(den)
    for branch, steps in den.step_cache.record(two.layers)["per_step"].items():
        ran = [n == two.layers for n, _ in steps]
        expected = [s < before or (s - before - 1) % interval == 0 or s == switch for s in range(GEN["steps"])]
        assert ran == expected, (branch, ran, expected)


def _calibration_target(rank, world, events):
    layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy="ring")
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    denoiser = build_denoiser(
        build_tiny_wan(MODEL),
        resolve_placement("cpu"),
        TEXT_LEN,
        mesh=mesh,
        comm=Comm(mesh),
        step_cache=parse_step_cache("magcache"),
    )
    denoiser.step_cache.calibrating = True
    denoise(denoiser)
    return denoiser.step_cache.take_calibration()


@pytest.mark.distributed
def test_magcache_ratios_measured_over_chunks_equal_one_process():
    """The calibration ratio is a mean over tokens: each rank holds a chunk, so the sum and the
    count are all-reduced; two ranks measure what one process measures."""
    denoiser = Denoiser(build_tiny_wan(MODEL), resolve_placement("cpu"), TEXT_LEN)
    denoiser.step_cache = StepCache(parse_step_cache("magcache"))
    denoiser.step_cache.calibrating = True
    denoise(denoiser)
    one = denoiser.step_cache.take_calibration()
    per_rank = run_ranks(_calibration_target, 2, (), timeout_s=TIMEOUT_S)
    assert len(one["cond"]) == GEN["steps"] and len(set(one["cond"])) > 2
    for measured in per_rank:
        for branch in ("cond", "uncond"):
            assert measured[branch] == pytest.approx(one[branch], abs=1e-5), branch


@pytest.mark.distributed
@pytest.mark.e2e
def test_cli_tp_and_cfg_parallel_with_a_step_cache_equal_one_process(runner, tmp_path):
    """Through the command: first-block cache under --parallel tp on 2 ranks decides as one
    process does (every rank holds the whole sequence: the all-reduced sums count it twice,
    the ratio is the same), and so does --cfg-parallel (each branch group decides its branch,
    as one process decides each branch's context); both give one process's latents. The
    report holds both branches' steps and counts tp's bytes."""
    from safetensors.torch import load_file

    cache = ["--step-cache", "first-block:threshold=0.4", "--save-latents", "--executor", "local"]
    args = ["generate", "--prompt", "a blue circle moving up", *FAST, *cache]
    runs = {
        "one": [],
        "tp": ["--gpus-per-node", "1", "--nodes", "2", "--parallel", "tp"],
        "cfg": ["--gpus-per-node", "2", "--cfg-parallel"],
    }
    reports, latents = {}, {}
    for name, extra in runs.items():
        result = runner.invoke(app, [*args, "--out", str(tmp_path / name), *extra])
        assert result.exit_code == 0, result.output
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())["items"][0]
        latents[name] = load_file(tmp_path / name / reports[name]["latents"])["latents"]
    one = reports["one"]["step_cache"]
    assert one["skipped_steps"]["cond"] and one["skipped_steps"]["cond"] != one["skipped_steps"]["uncond"]
    for name in ("tp", "cfg"):
        assert reports[name]["step_cache"]["per_step"] == one["per_step"], name
        assert (latents[name] - latents["one"]).abs().max() <= LATENT_ATOL, name
    assert reports["tp"]["comm"]["by_purpose"]["tp"]["inter_node_bytes"] > 0
