"""Exact context-parallel strategies x ranks on the built-in model: step time and bytes.

    .venv/bin/python benchmarks/cp.py [--steps 8] [--height 128 --width 128 --frames 17] [--out DIR]

Runs `ditango generate` for every configuration (fresh output dir, one item) and reads
its report.json. Step time is the median over steps 2.. of rank 0's per-step wall time.
Bytes are summed over ranks, per link class, for the whole item (2 CFG branches x steps).
On a 2-core CPU machine, 3-4 ranks oversubscribe the cores: the times show overheads,
not the scaling a GPU cluster gets; the byte columns are exact anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = [  # (strategy, gpus per node, nodes, extra args)
    ("none", 1, 1, []),
    ("ring", 2, 1, []),
    ("ulysses", 2, 1, []),
    ("ring", 2, 2, []),
    ("ulysses", 2, 2, []),
    ("usp", 2, 2, ["--ulysses-degree", "2"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--out", type=Path, default=None, help="keep outputs here (default: a temp dir)")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="ditango-cp-bench-"))
    exe = Path(sys.executable).with_name("ditango")
    rows = []
    for strategy, gpus, nodes, extra in CONFIGS:
        out = root / f"{strategy}-{nodes}x{gpus}"
        cmd = [
            str(exe),
            "generate",
            "--prompt",
            "a red circle moving left on a black background",
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--height",
            str(args.height),
            "--width",
            str(args.width),
            "--frames",
            str(args.frames),
            "--device",
            "cpu",
            "--quiet",
            "--overwrite",
            "--executor",
            "local",
            "--parallel",
            strategy,
            "--gpus-per-node",
            str(gpus),
            "--nodes",
            str(nodes),
            *extra,
        ]
        subprocess.run(cmd, check=True)
        report = json.loads((out / "report.json").read_text())
        item = report["items"][0]
        steps = item["timing"]["step_s"][1:] or item["timing"]["step_s"]
        comm = item["comm"]
        rows.append(
            (
                strategy,
                nodes * gpus,
                nodes,
                statistics.median(steps),
                item["tokens"],
                comm["intra_node_bytes"],
                comm["inter_node_bytes"],
            )
        )
    print(f"tiny-wan, {args.width}x{args.height}x{args.frames}, {args.steps} steps, CPU gloo; outputs in {root}\n")
    print("| strategy | ranks | nodes | step (s, median) | tokens | intra-node MB | inter-node MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s, r, n, t, tok, intra, inter in rows:
        print(f"| {s} | {r} | {n} | {t:.4f} | {tok} | {intra / 1e6:.2f} | {inter / 1e6:.2f} |")


if __name__ == "__main__":
    main()
