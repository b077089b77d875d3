"""--compile: the repeated block compiles with no graph break under every strategy, one graph
serves every layer, and the compiled run gives the eager run's latents (2 gloo ranks, and
one process on the built-in model). A compile that fails falls back to eager with one warning
and the record says why."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from planner.ditango import DiTangoOptions, PlannerConfig
from planner.layout import ParallelLayout, virtual_node_map
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.compile import CompiledForward, CompileRecord, compile_blocks, repeated_blocks, uncompile_blocks
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from slurm.launchers.processes import run_ranks
from tests.test_cp_pipeline import CP_MODEL as TWO_LAYERS
from tests.test_cp_pipeline import TEXT_LEN, denoise
from tiny_wan import build_tiny_wan

TIMEOUT_S = 120
CP_MODEL = replace(TWO_LAYERS, layers=4)  # more layers than graphs: one graph per layer would show
STRATEGIES = ("ring", "ulysses", "ditango", "tp")
DITANGO = DiTangoOptions(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=0))
REL_TOL = 1e-3  # the bound for compiled vs eager (relative L2); inductor reorders float sums


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class GraphCount:
    """A torch.compile backend that runs the graph as traced and counts the graphs made."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _strategy_target(rank, world, events, backend: str, strategies):
    components = build_tiny_wan(CP_MODEL)
    out = {}
    for name in strategies:
        layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy=name)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(mesh)
        ditango = DITANGO if layout.strategy.reuses else None

        def build(mesh=mesh, comm=comm, ditango=ditango):  # a fresh one: DiTango's cache starts empty
            return build_denoiser(components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm, ditango=ditango)

        den = build()
        eager = denoise(den)
        den.parallel.remove()
        den = build()
        counters.clear()
        torch._dynamo.reset()
        count = GraphCount()
        record = compile_blocks(den.transformers, CompileRecord(), backend=count if backend == "count" else backend)
        compiled = denoise(den)
        uncompile_blocks(den.transformers)
        den.parallel.remove()
        out[name] = dict(
            breaks=sum(counters["graph_break"].values()),
            reasons=[str(k)[:600] for k in counters["graph_break"]][:3],
            graphs=count.graphs,
            blocks=record.blocks,
            fallback=record.fallback,
            err=rel_err(compiled, eager),
        )
    return out


@pytest.mark.distributed
def test_no_graph_break_under_any_strategy():
    """Traced by dynamo alone (no inductor): every strategy's block compiles whole, the blocks
    share their graphs (a block count per graph would mean one per layer), and running the
    traced graphs gives the eager latents."""
    results = run_ranks(_strategy_target, 2, args=("count", STRATEGIES), timeout_s=600)
    for rank_out in results:
        for strategy, r in rank_out.items():
            assert r["fallback"] is None, (strategy, r)
            assert r["breaks"] == 0, (strategy, r)
            assert r["blocks"] == CP_MODEL.layers
            # One graph for the blocks, another once the layer index turned symbolic: never one per layer.
            assert 1 <= r["graphs"] <= 2, (strategy, r)
            assert r["err"] < 1e-6, (strategy, r)


@pytest.mark.distributed
@pytest.mark.sweep
def test_inductor_matches_eager_under_every_strategy():
    results = run_ranks(_strategy_target, 2, args=("inductor", STRATEGIES), timeout_s=900)
    for rank_out in results:
        for strategy, r in rank_out.items():
            assert r["fallback"] is None and r["breaks"] == 0, (strategy, r)
            assert r["err"] < REL_TOL, (strategy, r)


def test_one_process_inductor_matches_eager():
    """The built-in-size model on one process (diffusers' own attention, no strategy installed)."""
    components = build_tiny_wan(CP_MODEL)
    den = Denoiser(components, resolve_placement("cpu"), TEXT_LEN)
    eager = denoise(den)
    counters.clear()
    record = compile_blocks(den.transformers, CompileRecord())
    try:
        compiled = denoise(den)
    finally:
        uncompile_blocks(den.transformers)
    assert record.fallback is None and sum(counters["graph_break"].values()) == 0
    assert record.compile_s > 0 and len(record.shapes) == 1
    assert rel_err(compiled, eager) < REL_TOL
    assert not any(isinstance(b.__dict__.get("forward"), CompiledForward) for b in repeated_blocks(den.transformers[0]))


def test_failed_compile_runs_eager_with_one_warning():
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    components = build_tiny_wan(CP_MODEL)
    den = Denoiser(components, resolve_placement("cpu"), TEXT_LEN)
    eager = denoise(den)
    torch._dynamo.reset()
    record = compile_blocks(den.transformers, CompileRecord(), backend=broken)
    with pytest.warns(RuntimeWarning, match="--compile failed, running eager") as warned:
        again = denoise(den)
    uncompile_blocks(den.transformers)
    assert len(warned) == 1
    assert record.fallback is not None and "no compiler here" in record.fallback
    assert record.to_json()["fallback"] == record.fallback
    assert torch.equal(again, eager)
