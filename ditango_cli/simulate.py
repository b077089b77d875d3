"""`ditango simulate`: the cost model's table for a cluster layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from planner.errors import ConfigError

NodesOpt = Annotated[int, typer.Option("--nodes", help="Nodes of the cluster to price.")]
GpusOpt = Annotated[int, typer.Option("--gpus-per-node", "--gpus", help="GPUs per node.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def simulate(
    model: Annotated[str, typer.Option("--model", "-m", help="A registry name (ditango models).")] = "wan2.1-14b",
    nodes: NodesOpt = 4,
    gpus_per_node: GpusOpt = 8,
    hardware: Annotated[str, typer.Option("--hardware", help="h20, h100, h200, a100, l40s.")] = "h20",
    hardware_file: Annotated[
        Path | None, typer.Option("--hardware-file", help="JSON profile overriding --hardware.")
    ] = None,
    parallel: Annotated[
        str, typer.Option("--parallel", help="Comma-separated strategies.")
    ] = "ring,ulysses,usp,ditango",
    plan: Annotated[
        Path | None, typer.Option("--plan", help="report.json of a DiTango run: its computed fraction.")
    ] = None,
    cache_ratio: Annotated[float, typer.Option("--cache-ratio", help="DiTango without --plan.")] = 0.4,
    group_size: Annotated[str, typer.Option("--group-size", help="DiTango group: ranks or 'node'.")] = "node",
    height: Annotated[int, typer.Option("--height")] = 720,
    width: Annotated[int, typer.Option("--width")] = 1280,
    frames: Annotated[int, typer.Option("--frames")] = 81,
    steps: Annotated[int, typer.Option("--steps")] = 50,
    as_json: JsonOpt = False,
) -> int:
    """Price strategies on a hardware profile: per-step attention, step and end-to-end time, bytes."""
    from planner.cost_model import compare_layouts, load_hardware, read_plan, report_dict, synthetic_plan_fraction
    from runtime.models.registry import REGISTRY

    if model not in REGISTRY:
        raise ConfigError(f"unknown model {model!r} for simulate: use one of {', '.join(REGISTRY)}")
    shape = REGISTRY[model].shape  # one expert runs at a time: per-step costs are one transformer's
    hw = load_hardware(str(hardware_file) if hardware_file else hardware)
    strategies = [s.strip() for s in parallel.split(",") if s.strip()]
    for s in strategies:
        if s not in ("ring", "ulysses", "usp", "ditango"):
            raise ConfigError(f"--parallel {s!r}: simulate knows ring, ulysses, usp, ditango")
    plan_log = None
    if plan is not None:
        fraction, plan_log = read_plan(plan)
    else:
        fraction = synthetic_plan_fraction(cache_ratio, steps)
    rows, notes = compare_layouts(hw, shape, nodes, gpus_per_node, strategies, group_size, height, width, frames,
                                  steps, fraction, plan_log)  # fmt: skip
    assumptions = {**report_dict(hw), "model": model, "tokens": shape.tokens(height, width, frames),
                   "steps": steps, "ditango_computed_fraction": round(fraction, 4),
                   "ditango_plan": (f"{plan} (per ring offset from its plan file)" if plan_log is not None
                                    else str(plan)) if plan else f"synthetic, cache ratio {cache_ratio:g}",
                   "skipped": notes}  # fmt: skip
    if as_json:
        print(json.dumps({"schema": 1, "assumptions": assumptions, "rows": rows}, indent=2))
        return 0
    console = Console()
    console.print(
        f"{model}, {width}x{height}x{frames} ({assumptions['tokens']} tokens), {steps} steps, "
        f"{hw.name} x {gpus_per_node} per node; DiTango computes {fraction:.0%} of remote attention "
        f"({assumptions['ditango_plan']}). Bytes are exact counts; times are modelled (see --json assumptions).",
        highlight=False,
    )
    table = Table("strategy", "nodes", "attention/step (s)", "step (s)", "e2e (s)", "inter-node GB", "intra-node GB",
                  "vs best exact")  # fmt: skip
    for r in rows:
        speed = "-" if r["speedup_vs_best_exact"] is None else f"{r['speedup_vs_best_exact']:.2f}x"
        table.add_row(r["strategy"], str(r["nodes"]), f"{r['attention_s']:.3f}", f"{r['step_s']:.3f}",
                      f"{r['e2e_s']:.1f}", f"{r['inter_node_bytes'] / 1e9:.1f}", f"{r['intra_node_bytes'] / 1e9:.1f}",
                      speed)  # fmt: skip
    console.print(table)
    for note in notes:
        console.print(f"skipped: {note}", highlight=False)
    return 0
