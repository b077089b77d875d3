"""--compile: the repeated block compiles with no graph break under every strategy, one graph
serves every layer, and the compiled run gives the eager run's latents (2 gloo ranks, and
one process on the built-in model). A compile that fails falls back to eager with one warning
and the record says why."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from ditango_cli.app import app
from planner.ditango import DiTangoOptions, PlannerConfig
from planner.layout import ParallelLayout, virtual_node_map
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.compile import CompileRecord, compile_blocks, repeated_blocks, uncompile_blocks
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from runtime.weights import shard_weights
from slurm.launchers.processes import run_ranks
from tests.test_cp_pipeline import CP_MODEL as TWO_LAYERS
from tests.test_cp_pipeline import TEXT_LEN, denoise
from tiny_wan import build_tiny_wan

TIMEOUT_S = 120
CP_MODEL = replace(TWO_LAYERS, layers=4)  # more layers than graphs: one graph per layer would show
# "ring+fsdp": ring over blocks FSDP2 shards (wrapped in a subclass of their own); last, it
# shards the shared components for good.
STRATEGIES = ("ring", "ulysses", "ditango", "tp", "ring+fsdp")
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
        strategy, _, fsdp = name.partition("+")
        layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy=strategy)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(mesh)
        if fsdp:
            shard_weights(components, mesh, torch.device("cpu"))
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
@pytest.mark.sweep
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


@pytest.mark.e2e
def test_the_built_in_model_compiled_matches_eager(runner, tmp_path):
    """`ditango generate --compile` on one process (diffusers' own attention, no strategy):
    the final latents within 1e-3 of the eager run's, the report saying what compiled."""
    fast = ["--prompt", "a red circle moving left", "--steps", "3", "--height", "48", "--width", "64"]
    latents = {}
    for flag in ("--no-compile", "--compile"):
        out = tmp_path / flag
        result = runner.invoke(app, ["generate", *fast, "--out", str(out), "--save-latents", flag, "--device", "cpu"])
        assert result.exit_code == 0, result.output
        report = json.loads((out / "report.json").read_text())
        latents[flag] = next(iter(load_file(next(out.glob("*.latents.safetensors"))).values()))
    assert report["compile"]["enabled"] and report["compile"]["fallback"] is None
    assert report["compile"]["blocks"] == 4 and report["compile"]["compiles"] >= 1
    assert 0 < report["timing"]["compile_s"] <= report["timing"]["items_s"]
    assert rel_err(latents["--compile"], latents["--no-compile"]) < REL_TOL


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


@pytest.mark.sweep
def test_hunyuan_blocks_compile_whole_with_the_joint_attention():
    """HunyuanVideo's dual- and single-stream blocks under our joint-attention processor (a
    one-rank ring: the processor and its op, no peer): no graph break, the eager latents."""
    from tests.test_hunyuan import SIZES, denoiser, ours

    mesh = build_mesh(ParallelLayout(strategy="ring"), 0, (0,))
    den = denoiser(mesh=mesh, comm=Comm(mesh))
    eager = ours(den, SIZES[4], 4.0)
    counters.clear()
    torch._dynamo.reset()
    count = GraphCount()
    record = compile_blocks(den.transformers, CompileRecord(), backend=count)
    compiled = ours(den, SIZES[4], 4.0)
    uncompile_blocks(den.transformers)
    assert record.blocks == len(repeated_blocks(den.transformers[0])) >= 2
    assert record.fallback is None and sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # (graphs: a new one per text length, cond and uncond differ once the padding is dropped)
    assert count.graphs >= 2
    assert rel_err(compiled, eager) < 1e-6
