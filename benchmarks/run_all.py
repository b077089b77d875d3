"""The benchmark suite: strategies x ranks on the built-in model, one table and plots.

    .venv/bin/python benchmarks/run_all.py [--steps 20] [--results benchmarks/results]

Every configuration runs `ditango generate` on one fixed prompt (fresh output, one item,
CPU gloo; "nodes" are virtual nodes of local ranks). Writes to the results folder:
`results.md` (the table), `results.json`, and PNG bar charts whose groups follow the
table rows left to right: `bytes.png` (inter-node, intra-node MB), `computed.png`
(computed fraction of remote attention, all steps), `psnr.png` (PSNR vs the 1-process
output, capped at 100 dB for identical outputs), `time.png` (median step time).
PSNR is taken on frames decoded from each run's saved latents, not on the MP4s: H.264
noise (~35 dB here) would otherwise hide every difference smaller than the codec's.
On a 2-core machine 4 ranks oversubscribe the cores: times show overheads, bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import diffusers.utils.logging
import transformers.utils.logging
from safetensors.torch import load_file

from runtime.denoiser import Denoiser
from runtime.models.loading import load_components, resolve_placement
from runtime.models.resolve import resolve_model
from runtime.plots import write_bars
from runtime.quality import psnr

CONFIGS = [  # label, args
    ("1 process", []),
    ("ring 2", ["--gpus", "2", "--parallel", "ring"]),
    ("ulysses 2", ["--gpus", "2", "--parallel", "ulysses"]),
    ("cfg-parallel 2", ["--gpus", "2", "--cfg-parallel"]),
    ("ring 2x2", ["--gpus", "2", "--nodes", "2", "--parallel", "ring"]),
    ("ulysses 2x2", ["--gpus", "2", "--nodes", "2", "--parallel", "ulysses"]),
    ("usp 2x2", ["--gpus", "2", "--nodes", "2", "--parallel", "usp", "--ulysses-degree", "2"]),
    ("cfg-parallel + ring 2x2", ["--gpus", "2", "--nodes", "2", "--cfg-parallel", "--parallel", "ring"]),
    (
        "ditango 0.4, 2x2",
        ["--gpus", "2", "--nodes", "2", "--parallel", "ditango", "--reuse", "always", "--cache-ratio", "0.4"],
    ),
    (
        "ditango 0.8, 2x2",
        ["--gpus", "2", "--nodes", "2", "--parallel", "ditango", "--reuse", "always", "--cache-ratio", "0.8"],
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("ditango")
    started = time.perf_counter()
    rows = []
    for label, extra in CONFIGS:
        folder = out / "runs" / label.replace(" ", "_").replace(",", "").replace("+", "and")
        cmd = [
            str(exe),
            "generate",
            "--prompt",
            "a red circle moving left on a black background",
            "--out",
            str(folder),
            "--steps",
            str(args.steps),
            "--device",
            "cpu",
            "--quiet",
            "--overwrite",
            "--save-latents",
            "--executor",
            "local",
            *extra,
        ]
        subprocess.run(cmd, check=True)
        report = json.loads((folder / "report.json").read_text())
        item = report["items"][0]
        per_step = item["attention"].get("per_step", [1.0])
        rows.append(
            {
                "config": label,
                "ranks": report["layout"]["world_size"],
                "nodes": report["layout"]["nodes"],
                "inter_node_mb": item["comm"]["inter_node_bytes"] / 1e6,
                "intra_node_mb": item["comm"]["intra_node_bytes"] / 1e6,
                "computed_fraction_all_steps": sum(per_step) / len(per_step),
                "step_s": statistics.median(item["timing"]["step_s"][1:] or item["timing"]["step_s"]),
                "latents": str(folder / item["latents"]),
            }
        )
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    decoder = Denoiser(
        load_components(resolve_model("tiny-wan"), resolve_placement("cpu")), resolve_placement("cpu"), 32
    )

    def frames(row):
        return decoder.decode(load_file(row["latents"])["latents"])

    reference = frames(rows[0])
    for row in rows:
        p = psnr(frames(row), reference)
        row["psnr_vs_1_process"] = None if p == float("inf") else round(p, 3)
    lines = [
        f"tiny-wan 128x128x17, {args.steps} steps, CPU gloo (virtual nodes); suite wall time "
        f"{time.perf_counter() - started:.0f} s",
        "",
        "| config | ranks | nodes | inter-node MB | intra-node MB | computed (all steps) | PSNR vs 1 process (dB) "
        "| step (s, median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = "identical" if r["psnr_vs_1_process"] is None else f"{r['psnr_vs_1_process']:.2f}"
        lines.append(
            f"| {r['config']} | {r['ranks']} | {r['nodes']} | {r['inter_node_mb']:.2f} | {r['intra_node_mb']:.2f} "
            f"| {r['computed_fraction_all_steps']:.3f} | {p} | {r['step_s']:.4f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"schema": 1, "rows": rows}, indent=2) + "\n")
    figures(out, rows)
    print("\n".join(lines))


def figures(out: Path, rows: list[dict]) -> list[Path]:
    """The suite's bar charts, one group per config (benchmarks/figures.py redraws them)."""
    labels = [r["config"] for r in rows]
    identical = [100.0 if r["psnr_vs_1_process"] is None else r["psnr_vs_1_process"] for r in rows]
    charts = [
        (
            "bytes.png",
            {"inter-node": [r["inter_node_mb"] for r in rows], "intra-node": [r["intra_node_mb"] for r in rows]},
            "MB moved per item",
            "bytes moved between and inside (virtual) nodes",
        ),
        (
            "computed.png",
            {"computed": [r["computed_fraction_all_steps"] for r in rows]},
            "attention computed (fraction)",
            "attention computed over all steps",
        ),
        ("psnr.png", {"PSNR": identical}, "PSNR vs 1 process (dB; 100: identical)", "quality against one process"),
        ("time.png", {"step": [r["step_s"] for r in rows]}, "step time (s, median)", "step time on a 2-core CPU"),
    ]
    for name, series, y_label, title in charts:
        write_bars(out / name, labels, series, y_label, title)
    return [out / name for name, *_ in charts]


if __name__ == "__main__":
    main()
