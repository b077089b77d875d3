"""The shared queue against the round-robin split on a batch of uneven items.

12 items on the built-in model, 4 of them with 33 frames and the other 8 with 9, the long
ones at lines 1, 5, 9 and 12 of the prompt file (a file that lists takes in groups of four, one
long take a group, and one more at the end), run by 4 local replicas of 1 rank each, with the
queue (the default) and with `--queue static`, interleaved (queue, static, queue, ...) so that
the machine's drift hits both. Prints a markdown table.

    .venv/bin/python benchmarks/queue_makespan.py [--runs 3] [--steps 6] [--out benchmarks/results/queue.md]

The makespan is first item started to last item written: each item's start is its sidecar's
mtime less its `timing.total_s` (the item's whole time on its replica: inputs, denoising,
decode, writing); model loading, which every replica does once either way, is left out. The
ideal of a run is the larger of its longest item and the sum of its items over the 4 replicas
(no schedule does better). Target: the queue's makespan <= 1.15x its ideal, and below the
round-robin one's on the same items.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LONG = (0, 4, 8, 11)  # the long items' lines (from 0)
REPLICAS = 4


def prompt_file(folder: Path) -> Path:
    path = folder / "mixed.jsonl"
    lines = [
        json.dumps({"id": f"it{k:02d}", "prompt": f"a shape moving, take {k}", "frames": 33 if k in LONG else 9})
        for k in range(12)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(prompts: Path, out: Path, queue: str, steps: int) -> dict:
    cmd = [sys.executable, "-m", "ditango_cli.app", "generate", "--prompts", str(prompts), "--steps", str(steps)]
    cmd += ["--gpus-per-node", str(REPLICAS), "--replicas", str(REPLICAS), "--queue", queue, "--device", "cpu"]
    cmd += ["--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    spans = []
    for sidecar in sorted(out.glob("it*.json")):
        record = json.loads(sidecar.read_text())
        assert record["status"] == "done", record
        end = sidecar.stat().st_mtime
        spans.append((end - record["timing"]["total_s"], end, record["timing"]["total_s"]))
    assert len(spans) == 12, spans
    times = [s for _, _, s in spans]
    makespan = max(e for _, e, _ in spans) - min(b for b, _, _ in spans)
    ideal = max(max(times), sum(times) / REPLICAS)
    return {"makespan_s": makespan, "ideal_s": ideal, "ratio": makespan / ideal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None, help="Also write the table here.")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"shared": [], "static": []}
    with tempfile.TemporaryDirectory(prefix="ditango-queue-bench-") as tmp:
        prompts = prompt_file(Path(tmp))
        for k in range(args.runs):
            for queue in ("shared", "static"):
                results[queue].append(run(prompts, Path(tmp) / f"{queue}-{k}", queue, args.steps))
    rows = [
        "| --queue | makespan (s), median | ideal (s), median | makespan / ideal, median | worst / ideal | runs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for queue, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("makespan_s", "ideal_s", "ratio")}
        rows.append(
            f"| {queue} | {med['makespan_s']:.1f} | {med['ideal_s']:.1f} | {med['ratio']:.3f} | "
            f"{max(r['ratio'] for r in runs):.3f} | {len(runs)} |"
        )
    saved = statistics.median(r["makespan_s"] for r in results["static"]) / statistics.median(
        r["makespan_s"] for r in results["shared"]
    )
    table = "\n".join(rows) + f"\n\nround-robin / queue makespan: {saved:.2f}x\n"
    print(table)
    if args.out is not None:
        args.out.write_text(
            f"# Queue vs round-robin ({args.runs} runs each, {args.steps} steps, 4 replicas of 1 rank, CPU)\n\n" + table
        )


if __name__ == "__main__":
    main()
