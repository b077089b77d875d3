"""`ditango simulate`: the cost model's table for a cluster layout."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from planner.errors import ConfigError

NodesOpt = Annotated[int, typer.Option("--nodes", help="Nodes of the cluster to price.")]
GpusOpt = Annotated[int, typer.Option("--gpus-per-node", "--gpus", help="GPUs per node.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
ParallelOpt = Annotated[str, typer.Option("--parallel", help="Comma-separated strategies.")]
ParallelOpt = Annotated[str, typer.Option("--parallel", help="Comma-separated strategies.")]
HwFileOpt = Annotated[Path | None, typer.Option("--hardware-file", help="JSON profile overriding --hardware.")]
PlanOpt = Annotated[Path | None, typer.Option("--plan", help="report.json of a DiTango run: its computed fraction.")]
ShardOpt = Annotated[bool, typer.Option("--shard-weights", help="FSDP-shard the transformer over the ranks.")]
VaeParOpt = Annotated[bool | None, typer.Option("--vae-parallel/--no-vae-parallel", help="Default: with >1 rank.")]
TilingOpt = Annotated[bool, typer.Option("--vae-tiling", help="Tiled VAE decode (one process).")]
CacheDtype = Enum("CacheDtype", {"bfloat16": "bfloat16", "float32": "float32"}, type=str)  # type: ignore[misc]
CacheOpt = Annotated[CacheDtype, typer.Option("--cache-dtype", help="DiTango cache element type.")]
GpuMemOpt = Annotated[str | None, typer.Option("--gpu-memory", help="Per GPU, e.g. 80GiB (default: the profile's).")]


def simulate(
    model: Annotated[str, typer.Option("--model", "-m", help="A registry name (ditango models).")] = "wan2.1-14b",
    nodes: NodesOpt = 4,
    gpus_per_node: GpusOpt = 8,
    hardware: Annotated[str, typer.Option("--hardware", help="h20, h100, h200, a100, l40s.")] = "h20",
    hardware_file: HwFileOpt = None,
    parallel: ParallelOpt = "ring,ulysses,usp,ditango",
    plan: PlanOpt = None,
    cache_ratio: Annotated[float, typer.Option("--cache-ratio", help="DiTango without --plan.")] = 0.4,
    group_size: Annotated[str, typer.Option("--group-size", help="DiTango group: ranks or 'node'.")] = "node",
    height: Annotated[int, typer.Option("--height")] = 720,
    width: Annotated[int, typer.Option("--width")] = 1280,
    frames: Annotated[int, typer.Option("--frames")] = 81,
    steps: Annotated[int, typer.Option("--steps")] = 50,
    as_json: JsonOpt = False,
    shard_weights: ShardOpt = False,
    vae_parallel: VaeParOpt = None,
    vae_tiling: TilingOpt = False,
    cache_dtype: CacheOpt = CacheDtype.bfloat16,
    gpu_memory: GpuMemOpt = None,
) -> int:
    """Price strategies on a hardware profile: per-step attention, step and end-to-end time, bytes, peak memory."""
    from planner.cost_model import compare_layouts, load_hardware, memory_options, plan_fraction, simulate_assumptions
    from planner.memory import parse_bytes
    from runtime.models.registry import REGISTRY

    if model not in REGISTRY:
        raise ConfigError(f"unknown model {model!r} for simulate: use one of {', '.join(REGISTRY)}")
    spec = REGISTRY[model]  # one expert runs at a time: per-step costs are one transformer's (memory: all)
    hw = load_hardware(str(hardware_file) if hardware_file else hardware)
    fraction, plan_log = plan_fraction(plan, cache_ratio, steps)
    memory = memory_options(shard_weights, spec.defaults.cfg_scale, vae_tiling, cache_dtype.value)
    rows, notes = compare_layouts(hw, spec.shape, nodes, gpus_per_node, [s.strip() for s in parallel.split(",") if s.strip()],
                                  group_size, height, width, frames, steps, fraction, plan_log, memory, vae_parallel,
                                  parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None)  # fmt: skip
    assumptions = simulate_assumptions(hw, model, spec.shape.tokens(height, width, frames), steps, fraction, plan,
                                       plan_log, cache_ratio, notes)  # fmt: skip
    if as_json:
        print(json.dumps({"schema": 1, "assumptions": assumptions, "rows": rows}, indent=2))
        return 0
    Console().print(f"{model}, {width}x{height}x{frames} ({assumptions['tokens']} tokens), {steps} steps, {hw.name} x "
                    f"{gpus_per_node} per node; DiTango computes {fraction:.0%} of remote attention "
                    f"({assumptions['ditango_plan']}). Bytes are exact counts; times and memory are modelled (see "
                    "--json assumptions).", highlight=False)  # fmt: skip
    table = Table("strategy", "nodes", "attention/step (s)", "step (s)", "e2e (s)", "inter-node GB", "intra-node GB",
                  "vs best exact")  # fmt: skip
    memory = Table("strategy", "nodes", "weights GiB/GPU", "peak GiB/GPU", "peak phase", "offloaded", "fits")
    for r in rows:
        table.add_row(r["strategy"], str(r["nodes"]), f"{r['attention_s']:.3f}", f"{r['step_s']:.3f}",
                      f"{r['e2e_s']:.1f}", f"{r['inter_node_bytes'] / 1e9:.1f}", f"{r['intra_node_bytes'] / 1e9:.1f}",
                      "-" if r["speedup_vs_best_exact"] is None else f"{r['speedup_vs_best_exact']:.2f}x")  # fmt: skip
        memory.add_row(r["strategy"], str(r["nodes"]), f"{r['weights_bytes'] / 2**30:.1f}",
                       f"{r['peak_memory_bytes'] / 2**30:.1f}", r["peak_memory_stage"], ", ".join(r["offload"]) or "-",
                       {None: "-", True: "yes", False: "no"}[r["fits"]])  # fmt: skip
    Console().print(table, memory, *(f"skipped: {note}" for note in notes), sep="\n", highlight=False)
    return 0
