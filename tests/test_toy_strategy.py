"""A strategy added from outside the tool: one class and one `register` line in this file, and
the planner, the cost model, the layout search, the memory model and the runtime take it.

The toy is the simplest exact context parallelism there is: every rank all-gathers K and V of
the whole sequence over its cp group, then attends its own queries over them. This module is
also its runtime module (`build`), so the spawned ranks import it by name."""

from __future__ import annotations

import pytest
import torch

from basics.errors import ConfigError
from planner.cost_model import HARDWARE, estimate
from planner.layout import ParallelLayout, virtual_node_map
from planner.memory import estimate_memory
from planner.models import VideoSize
from planner.search import Problem, layouts, search
from planner.strategy import STRATEGIES, Strategy, register, strategy_named
from planner.traffic import predict_traffic
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.item_records import sum_comm
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from runtime.models.registry import REGISTRY
from runtime.strategies.exact import whole_attention
from slurm.launchers.processes import run_ranks
from tests.test_cost_model import SHAPE
from tests.test_cp_pipeline import CP_MODEL, TEXT_LEN, denoise
from tiny_wan import build_tiny_wan

LATENT_ATOL = 1e-4  # tests/test_cp_pipeline.py's bound for an exact strategy
TIMEOUT_S = 90


class AllGather(Strategy):
    name = "allgather"
    summary = "every rank gathers all K and V, then attends its queries over them (exact)"
    runtime = __name__

    def attention_traffic(self, t, topo, cp_ranks, sizes, shape, e, forwards, plan_bits, own_group):
        """K and V of every peer's chunk, padded to the longest (the collective's shape)."""
        block = forwards * shape.layers * 2 * max(sizes) * shape.heads * shape.head_dim * e
        for a in cp_ranks:
            for b in cp_ranks:
                if a != b:
                    t.add("attention", topo.link(a, b), block, a)

    def attention_time(self, hw, topo, shape, sizes, e, compute_fraction, own_group) -> float:
        bytes_in = (len(sizes) - 1) * 2 * max(sizes) * shape.heads * shape.head_dim * e
        link = "inter_node" if topo.layout.nodes > 1 else "intra_node"
        flops = 4.0 * max(sizes) * sum(sizes) * shape.heads * shape.head_dim
        return bytes_in / (hw.inter_gbps if link == "inter_node" else hw.intra_gbps) / 1e9 + flops / (
            hw.bf16_tflops * 1e12 * hw.attention_efficiency
        )


class AllGatherAttention:
    def attend(self, ctx, q_BSHD, k_BSHD, v_BSHD, scale, layer=0, extra_kv=None) -> torch.Tensor:
        mesh, comm = ctx.mesh, ctx.comm
        k, v = (
            comm.all_gather_seq(x, ctx.seq_sizes, mesh.cp_ranks, mesh.cp_group, purpose="attention")
            for x in (k_BSHD, v_BSHD)
        )
        return whole_attention(q_BSHD, k, v, scale, ctx.backend, extra_kv)


def build(ctx, transformers, options) -> AllGatherAttention:
    """The runtime side (planner/strategy.py `runtime` names this module)."""
    return AllGatherAttention()


TOY = AllGather()


def registered() -> None:
    if TOY.name not in STRATEGIES:
        register(TOY)


@pytest.fixture
def toy():
    registered()
    yield TOY
    STRATEGIES.pop(TOY.name)


def test_the_planner_and_the_search_take_it(toy):
    layout = ParallelLayout(nodes=2, gpus_per_node=4, strategy="allgather")
    assert layout.strategy is toy and (layout.cp_degree, layout.ring, layout.ulysses) == (8, 8, 1)
    assert layout.to_json()["strategy"] == "allgather"
    with pytest.raises(ConfigError, match="--group-size only applies to --parallel ditango"):
        ParallelLayout(nodes=1, gpus_per_node=4, strategy="allgather", group_size=2)
    with pytest.raises(ValueError, match="not taken"):
        register(AllGather())  # a name is taken once

    spec = REGISTRY["wan2.1-14b"]
    size = VideoSize(720, 1280, 81)
    moved = predict_traffic(layout, spec.shape, size, 40)["by_purpose"]["attention"]
    chunk = -(-spec.shape.tokens(size) // 8)  # the longest of 8 chunks
    per_rank = 40 * 2 * spec.shape.layers * 7 * 2 * chunk * spec.heads * spec.head_dim * 2  # 2 branches, 7 peers
    assert moved["inter_node_bytes"] + moved["intra_node_bytes"] == 8 * per_rank
    assert moved["inter_node_bytes"] == 8 * per_rank * 4 // 7  # 4 of each rank's 7 peers on the other node
    est = estimate(HARDWARE["h100"], layout, spec.shape, size, 40)
    ring = estimate(HARDWARE["h100"], ParallelLayout(nodes=2, gpus_per_node=4, strategy="ring"), spec.shape, size, 40)
    assert 0 < ring.attention_s < est.attention_s  # the same FLOPs, its transfers not hidden behind them
    assert estimate_memory(spec.shape, layout, size).peak_bytes > 0

    problem = Problem(spec.shape, size, 40, 1, 4, 1, 5.0, "latency", False, 0, None)
    assert any(lay.strategy is toy for lay in layouts(problem, 1, 4))
    choices, _ = search(HARDWARE["h100"], problem)
    mine = [c for c in choices if c.layout.strategy is toy]
    assert mine and mine[0].flags()[:2] == ["--parallel", "allgather"] and "[allgather " in mine[0].label


def test_an_unknown_name_lists_the_registered_ones(toy):
    with pytest.raises(ConfigError, match=r"must be one of ring, .*allgather, got 'nope'"):
        strategy_named("nope")


def _target(rank, world, events):
    registered()  # a spawned rank imports this module, but runs no fixture
    components = build_tiny_wan(CP_MODEL)
    layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy="allgather")
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    comm = Comm(mesh)
    denoiser = build_denoiser(components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm)
    latents = denoise(denoiser)
    denoiser.parallel.remove()
    return latents, comm.totals()


@pytest.mark.distributed
def test_it_runs_exact_and_moves_what_the_cost_model_says(toy):
    one = build_denoiser(build_tiny_wan(CP_MODEL), resolve_placement("cpu"), TEXT_LEN)
    reference = denoise(one)
    per_rank = run_ranks(_target, 3, timeout_s=TIMEOUT_S)  # 30 tokens over 3 ranks
    for latents, _ in per_rank:
        assert (latents - reference).abs().max().item() <= LATENT_ATOL
        assert torch.equal(latents, per_rank[0][0])
    measured = sum_comm([totals for _, totals in per_rank])
    layout = ParallelLayout(nodes=1, gpus_per_node=3, strategy="allgather")
    assert predict_traffic(layout, SHAPE, VideoSize(48, 80, 5), 3, element_bytes=4) == measured
    assert measured["by_purpose"]["attention"]["intra_node_bytes"] > 0
