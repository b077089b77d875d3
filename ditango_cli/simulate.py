"""`ditango simulate`: the cost model's table for a cluster layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ditango_cli.app import app
from ditango_cli.options import GpusOpt, JsonOpt, NodesOpt
from runtime.errors import ConfigError
from runtime.mesh import ParallelLayout


@app.command()
def simulate(
    model: Annotated[str, typer.Option("--model", "-m", help="wan2.1-1.3b, wan2.1-14b, hunyuanvideo, tiny-wan.")] = (
        "wan2.1-14b"
    ),
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
    from planner.cost_model import (
        MODELS,
        estimate,
        load_hardware,
        map_plan_offsets,
        plan_fraction_from_report,
        report_dict,
        synthetic_plan_fraction,
    )  # fmt: skip

    if model not in MODELS:
        raise ConfigError(f"unknown model {model!r} for simulate: use one of {', '.join(MODELS)}")
    shape = MODELS[model]
    hw = load_hardware(str(hardware_file) if hardware_file else hardware)
    strategies = [s.strip() for s in parallel.split(",") if s.strip()]
    for s in strategies:
        if s not in ("ring", "ulysses", "usp", "ditango"):
            raise ConfigError(f"--parallel {s!r}: simulate knows ring, ulysses, usp, ditango")
    plan_log = None
    if plan is not None:
        try:
            report = json.loads(plan.read_text(encoding="utf-8"))
            fraction = plan_fraction_from_report(report)
            plan_files = [(i.get("attention") or {}).get("plan_file") for i in report.get("items", [])]
            plan_file = next((plan.parent / f for f in plan_files if f), None)
            if plan_file is not None and plan_file.is_file():
                plan_log = json.loads(plan_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--plan {plan}: cannot read ({exc})") from None
    else:
        fraction = synthetic_plan_fraction(cache_ratio, steps)
    rows, notes = [], []
    for n in range(1, nodes + 1):
        found = []
        for s in strategies:
            try:
                group = None
                if s == "ditango":
                    group = gpus_per_node if group_size == "node" else int(group_size)
                layout = ParallelLayout(n, gpus_per_node, 1, s, None, group).with_default_ulysses(shape.heads)
                layout.check_model(shape.heads)
            except (ConfigError, ValueError) as exc:
                notes.append(f"{s} on {n} node(s): {exc}")
                continue
            f = fraction
            if s == "ditango" and plan_log is not None:
                f = map_plan_offsets(plan_log, layout.groups)  # per ring offset, by relative distance
            est = estimate(hw, layout, shape, height, width, frames, steps,
                           compute_fraction=f if s == "ditango" else 1.0)  # fmt: skip
            found.append(est)
        exact = [e.e2e_s for e in found if e.strategy != "ditango"]
        best = min(exact) if exact else None
        for e in found:
            rows.append(
                {"strategy": e.strategy, "nodes": e.nodes, "gpus_per_node": e.gpus_per_node,
                 "attention_s": round(e.attention_s, 6), "step_s": round(e.step_s, 6), "e2e_s": round(e.e2e_s, 4),
                 "inter_node_bytes": e.inter_node_bytes, "intra_node_bytes": e.intra_node_bytes,
                 "speedup_vs_best_exact": None if best is None else round(best / e.e2e_s, 4)}
            )  # fmt: skip
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
