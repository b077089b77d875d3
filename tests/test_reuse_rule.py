"""DiTango's no-loss rule (planner/reuse.py): reuse only where it saves more attention than its
bookkeeping costs; elsewhere the item runs the exact ring, and the report says why."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from planner.cost_model import HARDWARE
from planner.ditango import RUN_DEFAULTS, PlannerConfig
from planner.layout import ParallelLayout, chunk_bounds, chunk_sizes, virtual_node_map
from planner.reuse import CPU, ReuseCosts, device_hardware, reuse_costs
from runtime.comm import Comm
from runtime.kernels import reference_attention
from runtime.mesh import build_mesh
from runtime.strategies import selective
from runtime.strategies.exact import EXACT
from runtime.strategies.parallelize import ShardContext
from slurm.launchers.processes import run_ranks
from tests.cli_runs import TWO_SMALL_RANKS, generate

TIMEOUT_S = 90
B, H, D = 1, 4, 8
LATENTS = (B, 4, 1, 12, 12)  # 36 tokens at patch (1, 2, 2)


def test_the_profile_is_the_devices():
    assert device_hardware("cpu") is CPU
    assert device_hardware("cuda", "NVIDIA H100 80GB HBM3").name == "h100"
    assert device_hardware("cuda", "NVIDIA H200").name == "h200"
    assert device_hardware("cuda", "NVIDIA A100-SXM4-80GB").name == "a100"
    assert device_hardware("cuda", "Some Future GPU").name == "h20"  # the slowest profile: reuse saves most


@pytest.mark.parametrize(("hw", "few"), [(CPU, 64), (HARDWARE["h100"], 1_024)], ids=["cpu", "h100"])
def test_reuse_pays_on_long_videos_and_not_on_short_ones(hw, few):
    layout = ParallelLayout(nodes=4, gpus_per_node=8, strategy="ditango")
    heads, head_dim = 40, 128  # Wan2.1-14B's attention

    def costs(tokens: int, ratio: float) -> ReuseCosts:
        return reuse_costs(hw, layout, heads, head_dim, tokens, cache_ratio=ratio)

    # A few tokens on two ranks of one node: a dozen small kernels outweigh the attention and the fetch.
    pair = ParallelLayout(nodes=1, gpus_per_node=2, strategy="ditango", group_size=1)
    assert not reuse_costs(hw, pair, heads, head_dim, few, cache_ratio=0.4).pays
    assert costs(75_600, 0.4).pays  # 720p, 81 frames
    # Saving grows with the ratio, and with the tokens faster than the bookkeeping (attention is quadratic,
    # fetches linear; the bookkeeping is linear passes and a fixed count of kernels).
    assert costs(75_600, 0.8).saved_s > costs(75_600, 0.4).saved_s > costs(75_600, 0.2).saved_s
    short, long = costs(4_096, 0.4), costs(40_960, 0.4)
    assert long.saved_s / short.saved_s > max(5.0, long.bookkeeping_s / short.bookkeeping_s)
    # The budget planner measures more per recomputed cell: its bookkeeping is never smaller.
    budget = reuse_costs(hw, layout, heads, head_dim, 4_096, cache_ratio=0.4, planner="budget")
    assert budget.bookkeeping_s > short.bookkeeping_s and budget.saved_s == short.saved_s


def test_a_run_checks_by_default_and_the_library_reuses_as_planned():
    assert RUN_DEFAULTS.reuse == "auto" and PlannerConfig().reuse == "always"
    with pytest.raises(Exception, match="reuse"):
        PlannerConfig(reuse="sometimes")


def _rule_target(rank, world, events, verdicts):
    """Rank r's own verdict is verdicts[r] (None: the cost model's); returns (exact_only, kinds, max |out - ring|,
    max |out - reference|, cache bytes)."""
    layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy="ditango", group_size=1)
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    comm = Comm(mesh)
    if verdicts[rank] is not None:
        pays = verdicts[rank]
        selective.run_reuse_costs = lambda *a, **k: ReuseCosts(2.0 if pays else 1.0, 1.5, "test")
    cfg = PlannerConfig(warmup=0, cooldown=1, cache_ratio=0.5, reuse="auto")
    rt = selective.SelectiveRuntime(mesh, comm, "sdpa", cfg, layers=1, heads=H, head_dim=D)
    rt.begin_run(torch.zeros(LATENTS), steps=3, branches=1)
    ctx = ShardContext(mesh, comm, "sdpa", strategy=rt)
    ctx.begin_forward(36)
    a, b = chunk_bounds(chunk_sizes(36, world), mesh.cp_index)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 36, H, D, generator=g) for _ in range(3))
    ref = reference_attention(q, k, v, D**-0.5)[0][:, a:b]
    kinds, ring_err, ref_err = [], 0.0, 0.0
    for step in range(3):
        rt.begin_step(step)
        kinds.append(rt.step_plan.kind)
        out = ctx.attention(q[:, a:b], k[:, a:b], v[:, a:b], D**-0.5)
        ring = EXACT.attend(ctx, q[:, a:b], k[:, a:b], v[:, a:b], D**-0.5)
        ring_err = max(ring_err, (out - ring).abs().max().item())
        ref_err = max(ref_err, (out.double() - ref).abs().max().item())
        rt.end_step(step)
    report = rt.item_report()
    return rt.exact_only, kinds, ring_err, ref_err, rt.cache.nbytes(), report["reuse"]


@pytest.mark.distributed
def test_where_reuse_does_not_pay_the_item_runs_the_exact_ring():
    """36 tokens on 2 CPU ranks: the cost model rules reuse out; every step is the ring, bit for bit."""
    results = run_ranks(_rule_target, 2, ([None, None],), timeout_s=TIMEOUT_S)
    for exact_only, kinds, ring_err, ref_err, cache_bytes, reuse in results:
        assert exact_only and kinds == ["exact"] * 3 and cache_bytes == 0
        assert ring_err == 0.0 and ref_err < 1e-5
        assert reuse["pays"] is False and reuse["bookkeeping_us_per_layer"] > reuse["saved_us_per_layer"] > 0
        assert reuse["hardware"] == "cpu"


@pytest.mark.distributed
def test_ranks_agree_on_the_verdict_and_reuse_where_it_pays():
    """One rank's model says no: no rank reuses (their exchanges must pair up). Both say yes: the plan reuses."""
    for verdicts, reused in (([True, False], False), ([True, True], True)):
        results = run_ranks(_rule_target, 2, (verdicts,), timeout_s=TIMEOUT_S)
        for exact_only, kinds, _, ref_err, cache_bytes, reuse in results:
            assert exact_only is not reused and reuse["pays"] is reused and ref_err < 1e-5
            assert ("selective" in kinds) is reused and (cache_bytes > 0) is reused


def _generate(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    report, stderr = generate(out, *TWO_SMALL_RANKS, "--steps", "4", "--save-latents", *extra)
    item = report["items"][0]
    return {"item": item, "stderr": stderr, "latents": load_file(out / item["latents"])}


@pytest.mark.e2e
def test_a_run_says_so_and_equals_the_ring(tmp_path):
    ditango = _generate(
        tmp_path, "ditango", "--parallel", "ditango", "--cache-ratio", "0.8", "--warmup", "1", "--cooldown", "1"
    )
    ring = _generate(tmp_path, "ring", "--parallel", "ring")
    attention = ditango["item"]["attention"]
    assert attention["reuse"]["pays"] is False and attention["computed_fraction_all_steps"] == 1.0
    assert "reuse would cost more than it saves" in ditango["stderr"] and "--reuse always" in ditango["stderr"]
    for name, tensor in ring["latents"].items():
        assert torch.equal(ditango["latents"][name], tensor)


def test_the_reuse_mode_is_not_part_of_an_items_making(tmp_path):
    """Folders made before --reuse (or under the other mode) resume; the cache ratio still counts."""
    from dataclasses import replace

    from basics.errors import ConfigError
    from planner.ditango import DiTangoOptions
    from runtime.config import Item, RunConfig
    from runtime.outputs import output_paths, video_method
    from runtime.report import item_record
    from runtime.resume import plan_resume
    from runtime.video import write_json

    item = Item("x", "a red ball", "", 0, 32, 32, 5, 2, 5.0)
    layout = ParallelLayout(nodes=1, gpus_per_node=2, strategy="ditango", group_size=1)
    cfg = RunConfig("tiny-wan", None, (item,), tmp_path, layout=layout, ditango=DiTangoOptions(RUN_DEFAULTS))
    made = video_method(replace(cfg, ditango=DiTangoOptions(replace(RUN_DEFAULTS, reuse="always"))))
    assert "reuse" not in made["ditango"]["planner"] and made == video_method(cfg)
    paths = output_paths(tmp_path, "x")
    paths["video"].write_bytes(b"mp4")
    record = item_record(item, model="tiny-wan", status="done", video="x.mp4", latents=None, timing=None)
    write_json(paths["sidecar"], {**record, "method": made})
    assert set(plan_resume(cfg)) == {"x"}
    other = replace(cfg, ditango=DiTangoOptions(replace(RUN_DEFAULTS, cache_ratio=0.8)))
    with pytest.raises(ConfigError, match="was made with ditango"):
        plan_resume(other)
