"""DiTango's per-step time against the exact ring on the same ranks, over cache ratios.

    .venv/bin/python benchmarks/reuse.py [--ranks 2,4] [--ratios 0.2,0.4,0.6,0.8] [--rounds 2]
        [--steps 16] [--warmup 3] [--cooldown 3] [--frames 17] [--height 192 --width 192]
        [--reuse auto] [--out DIR]

The built-in model (`tiny-wan`), one prompt, CPU gloo, DiTango's own local launcher, one
group per rank (`--group-size 1`: every other rank's chunk a decision unit). Each round runs,
per rank count, the exact ring and DiTango at every ratio, in turn (interleaved: machine drift
hits all alike). `--reuse auto` is a run's default (reuse only where the cost model says it
pays: planner/reuse.py); `--reuse always` shows what reuse costs where it is forced.

Per run the time is the mean step time of rank 0's item (every step: DiTango's exact,
anchor and selective steps all count, as they do in a batch). The table shows per rank count
and ratio the median over rounds, its ratio to the ring's (below 1: faster), the share of
attention computed over all steps, the rule's verdict and its modelled saving and
bookkeeping per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DITANGO = Path(sys.executable).parent / "ditango"


def command(args, ranks: int, ratio: float | None, out: Path) -> list[str]:
    work = f"--seed 0 --frames {args.frames} --height {args.height} --width {args.width} --steps {args.steps}"
    work += f" --gpus {ranks} --quiet --overwrite"
    if ratio is None:
        work += " --parallel ring"
    else:
        work += f" --parallel ditango --group-size 1 --cache-ratio {ratio} --warmup {args.warmup}"
        work += f" --cooldown {args.cooldown} --reuse {args.reuse}"
    return [str(DITANGO), "generate", "--prompt", args.prompt, "--out", str(out), *work.split()]


def result(out: Path) -> tuple[float, dict]:
    item = json.loads((out / "report.json").read_text())["items"][0]
    return statistics.mean(item["timing"]["step_s"]), item["attention"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="a red circle moving left on a black background")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--ratios", default="0.2,0.4,0.6,0.8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cooldown", type=int, default=3)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--height", type=int, default=192)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--reuse", choices=("auto", "always"), default="auto")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="ditango-reuse-"))
    ratios = [float(r) for r in args.ratios.split(",")]
    runs = [(int(n), r) for n in args.ranks.split(",") for r in [None, *ratios]]
    times: dict[tuple[int, float | None], list[float]] = {run: [] for run in runs}
    attention: dict[tuple[int, float | None], dict] = {}
    for n in range(args.rounds):
        for ranks, ratio in runs[n % len(runs) :] + runs[: n % len(runs)]:  # each round starts elsewhere
            out = root / f"{ranks}-{ratio or 'ring'}-{n}"
            done = subprocess.run(command(args, ranks, ratio, out), capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{ranks} ranks, ratio {ratio}: failed:\n{done.stderr[-3000:]}")
            step_s, attention[(ranks, ratio)] = result(out)
            times[(ranks, ratio)].append(step_s)
            print(f"round {n + 1}: {ranks} ranks {ratio or 'ring'}: {step_s:.3f} s/step", file=sys.stderr)
    cores = len(os.sched_getaffinity(0))
    print(
        f"tiny-wan, {args.width}x{args.height}x{args.frames}, {args.steps} steps (DiTango: warm-up {args.warmup}, "
        f"cool-down {args.cooldown}, --group-size 1, --reuse {args.reuse}), CPU gloo on {cores} cores, median of "
        f"{args.rounds} interleaved rounds of the mean step\n"
    )
    print(
        "| ranks | run | s/step | vs ring | attention computed | reuse pays (model) | saved / bookkeeping per layer |"
    )
    print("|---:|---|---:|---:|---:|---|---:|")
    for ranks, ratio in runs:
        t = statistics.median(times[(ranks, ratio)])
        ring = statistics.median(times[(ranks, None)])
        record = attention[(ranks, ratio)]
        verdict = record.get("reuse")
        pays = "-" if ratio is None else ("forced" if verdict is None else ("yes" if verdict["pays"] else "no: ring"))
        costs = "-"
        if verdict is not None:
            costs = f"{verdict['saved_us_per_layer']:.0f} / {verdict['bookkeeping_us_per_layer']:.0f} us"
        name = "exact ring" if ratio is None else f"DiTango {ratio:g}"
        computed = record.get("computed_fraction_all_steps", 1.0)
        print(f"| {ranks} | {name} | {t:.3f} | {t / ring:.2f}x | {computed:.0%} | {pays} | {costs} |")


if __name__ == "__main__":
    main()
