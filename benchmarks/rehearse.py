"""The memory model and the byte counts against `ditango rehearse` at real scale, no GPU needed.

    python benchmarks/rehearse.py                 # every case below, a markdown table
    python benchmarks/rehearse.py --models hunyuanvideo --layouts 1x8 --strategies ring

Each case runs `ditango rehearse --json` (the first, the last and each rank whose shapes
differ) and `ditango simulate --json` for the same model, layout and strategy, 1280x720x81,
bfloat16, GPUs of 80 GiB (H100-80GB). Columns: the writer's traced / modelled peak (GiB) and
phase, the worst ratio of a rank's traced to modelled peak, the inter-node bytes per step
summed over the rank the rehearsal traced against planner/traffic.py's count for it, and
simulate's peak for the layout (what the pre-flight sees) and inter-node bytes per step (its
item count / steps: an exact strategy's every step; DiTango's is an average over its plan).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from planner.strategy import strategy_named

GIB = 2**30
MODELS = ("wan2.1-14b", "wan2.2-a14b", "hunyuanvideo")
LAYOUTS = ("1x8", "4x8")
STRATEGIES = ("ring", "usp", "ditango", "tp")


def run(args: list[str]) -> tuple[int, dict | None, float]:
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    try:
        return done.returncode, json.loads(done.stdout), time.perf_counter() - start
    except json.JSONDecodeError:
        return done.returncode, {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}, time.perf_counter() - start


def case(model: str, layout: str, strategy: str) -> dict:
    nodes, gpus = layout.split("x")
    size = ["--height", "720", "--width", "1280", "--frames", "81"]
    where = ["--nodes", nodes, "--gpus-per-node", gpus]
    extra = ["--group-size", "node"] if "group_size" in strategy_named(strategy).options else []
    code, report, seconds = run(
        ["ditango", "rehearse", "--model", model, *size, *where, "--parallel", strategy, *extra, "--json"]
    )
    if not report or "ranks" not in report:
        return {"model": model, "layout": layout, "strategy": strategy, "error": (report or {}).get("error")}
    steps = report["item"]["steps"]
    _, sim, _ = run(
        [
            "ditango",
            "simulate",
            "--model",
            model,
            "--nodes",
            nodes,
            "--gpus-per-node",
            gpus,
            "--parallel",
            strategy,
            "--hardware",
            "h100",
            "--gpu-memory",
            "80GiB",
            "--steps",
            str(steps),
            "--json",
            *size[:6],
        ]
    )
    row = next((r for r in (sim or {}).get("rows", []) if r["nodes"] == int(nodes)), None)
    writer = report["ranks"][0]
    return {
        "model": model,
        "layout": layout,
        "strategy": strategy,
        "exit": code,
        "seconds": round(seconds),
        "problems": report["problems"],
        "writer_peak": writer["peak"],
        "writer_phase": max(writer["phases"], key=lambda p: writer["phases"][p]["traced_bytes"]),
        "worst_ratio": max((r["peak"]["ratio"] for r in report["ranks"]), key=lambda x: abs(x - 1)),
        "inter_traced": sum(r["bytes_per_step"]["inter_node_bytes"] for r in report["ranks"]),
        "inter_modelled": sum(r["modelled_bytes_per_step"]["inter_node_bytes"] for r in report["ranks"]),
        "simulate_peak": None if row is None else row["peak_memory_bytes"],
        "simulate_inter_per_step": None if row is None else row["inter_node_bytes"] / steps,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | layout | strategy | time s | writer peak GiB traced / modelled (phase) | worst rank peak ratio "
        "| inter-node GB/step, traced ranks: traced / traffic.py | simulate peak GiB | simulate inter-node GB/step "
        "| problems |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layout']} | {r['strategy']} | - | {r['error']} | | | | | |")
            continue
        p = r["writer_peak"]
        sim_peak = "-" if r["simulate_peak"] is None else f"{r['simulate_peak'] / GIB:.1f}"
        sim_inter = "-" if r["simulate_inter_per_step"] is None else f"{r['simulate_inter_per_step'] / 1e9:.1f}"
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['strategy']} | {r['seconds']} | {p['traced_bytes'] / GIB:.1f} / "
            f"{p['modelled_bytes'] / GIB:.1f} ({r['writer_phase']}) | {r['worst_ratio']:.3f} | "
            f"{r['inter_traced'] / 1e9:.1f} / {r['inter_modelled'] / 1e9:.1f} | {sim_peak} | {sim_inter} | "
            f"{len(r['problems'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            for strategy in args.strategies.split(","):
                if strategy_named(strategy).splits_weights and model == "hunyuanvideo":
                    continue  # tp: not supported for its joint blocks (planner/layout.py)
                rows.append(case(model, layout, strategy))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
