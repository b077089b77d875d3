"""DiTango beside its peers on the same work: per-step time and output, side by side.

    .venv/bin/python benchmarks/peers.py [--ranks 2] [--rounds 3] [--steps 4] [--frames 17]
        [--height 256 --width 256] [--guidance 2.5] [--strategies ring,ulysses] [--out DIR]

The built-in model (`tiny-wan`), one prompt, CPU gloo. Each round runs every configuration
once, in turn (interleaved: machine drift hits all alike):
- diffusers: diffusers' own context parallelism (`ContextParallelConfig`, ring or Ulysses
  degree = --ranks), WanPipeline under torchrun (benchmarks/peer_worker.py);
- ditango torchrun: `ditango generate --executor env` under torchrun;
- ditango local: `ditango generate --executor local` (DiTango's own launcher).
Every rank computes with OMP_NUM_THREADS = cores / ranks (torchrun's own default is 1).

Per run, the step time is the median of steps 2.. (the first includes text encoding and
warm-up) of rank 0; the table shows the median over rounds, its ratio to diffusers' time for
the same strategy, and the largest |difference| of the run's final latents from a 1-process
WanPipeline on the same inputs (computed here, first). A run that differs by more than
--atol stops the benchmark: timing different computations means nothing.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

HERE = Path(__file__).resolve().parent


def reference_latents(args) -> torch.Tensor:
    """1-process WanPipeline on the same inputs as every run."""
    from peer_worker import generate_latents, wan_pipeline

    return generate_latents(*wan_pipeline("tiny-wan"), args)


WORK = ("prompt", "seed", "steps", "guidance", "height", "width", "frames")  # the options every run takes


def work(args) -> list[str]:
    return [part for name in WORK for part in (f"--{name}", str(getattr(args, name)))]


def torchrun(args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]


def ditango_args(args, strategy: str, out: Path) -> list[str]:
    fixed = "--device cpu --no-vae-parallel --save-latents --overwrite --quiet".split()
    return ["generate", *work(args), *fixed, "--parallel", strategy, "--out", str(out)]


def command(args, peer: str, strategy: str, out: Path) -> list[str]:
    """The command line of one run, writing under `out`."""
    if peer == "diffusers":
        degrees = [f"--{strategy}", str(args.ranks)]  # the two strategies diffusers' degrees are set for
        return [*torchrun(args), str(HERE / "peer_worker.py"), *degrees, "--out", str(out), *work(args)]
    ditango = [*ditango_args(args, strategy, out), "--executor"]
    if peer == "ditango torchrun":
        return [*torchrun(args), "-m", "ditango_cli.app", *ditango, "env"]
    return [sys.executable, "-m", "ditango_cli.app", *ditango, "local", "--gpus", str(args.ranks)]


def result(peer: str, out: Path) -> tuple[list[float], torch.Tensor]:
    """(rank 0's step times, final latents) a run left in `out`."""
    if peer == "diffusers":
        return json.loads((out / "steps.json").read_text()), load_file(out / "latents.safetensors")["latents"]
    (item,) = json.loads((out / "report.json").read_text())["items"]
    return item["timing"]["step_s"], load_file(next(out.glob("*.latents.safetensors")))["latents"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="a red circle moving left on a black background")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--guidance", type=float, default=2.5)
    ap.add_argument("--strategies", default="ring,ulysses")
    ap.add_argument("--peers", default="diffusers,ditango torchrun,ditango local")
    ap.add_argument("--atol", type=float, default=1e-4, help="largest |latent difference| from 1 process")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")
    if not set(args.strategies.split(",")) <= {"ring", "ulysses"}:
        ap.error("--strategies: ring and/or ulysses (diffusers' degrees are set for these two)")
    root = args.out or Path(tempfile.mkdtemp(prefix="ditango-peers-"))
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // args.ranks))}
    reference = reference_latents(args)
    runs = [(peer, s) for s in args.strategies.split(",") for peer in args.peers.split(",")]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    diffs: dict[tuple[str, str], float] = {}
    for n in range(args.rounds):
        for peer, strategy in runs[n % len(runs) :] + runs[: n % len(runs)]:  # each round starts elsewhere
            out = root / f"{peer.replace(' ', '-')}-{strategy}-{n}"
            done = subprocess.run(command(args, peer, strategy, out), env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{peer} {strategy} failed:\n{done.stderr[-3000:]}")
            steps, latents = result(peer, out)
            diff = (latents - reference).abs().max().item()
            if diff > args.atol:
                raise SystemExit(f"{peer} {strategy}: max |latent diff| {diff:.2e} > {args.atol:g}: not the same work")
            diffs[(peer, strategy)] = max(diff, diffs.get((peer, strategy), 0.0))
            times[(peer, strategy)].append(statistics.median(steps[1:]))
            print(f"round {n + 1}: {peer} {strategy}: {times[(peer, strategy)][-1]:.3f} s/step", file=sys.stderr)
    print(
        f"tiny-wan, {args.width}x{args.height}x{args.frames}, {args.steps} steps, guidance {args.guidance:g}, "
        f"{args.ranks} ranks (gloo, {env['OMP_NUM_THREADS']} threads each), median of {args.rounds} interleaved "
        "rounds of the median step 2..\n"
    )
    print("| strategy | run | s/step | vs diffusers | max abs diff vs 1 process |")
    print("|---|---|---:|---:|---:|")
    for peer, strategy in runs:
        t = statistics.median(times[(peer, strategy)])
        base = times.get(("diffusers", strategy))
        ratio = f"{t / statistics.median(base):.2f}x" if base else "-"
        print(f"| {strategy} | {peer} | {t:.3f} | {ratio} | {diffs[(peer, strategy)]:.1e} |")


if __name__ == "__main__":
    main()
