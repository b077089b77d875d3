"""1 process vs CFG-parallel vs Hybridiff on the built-in model.

    .venv/bin/python benchmarks/hybrid.py [--steps 50] [--ks 3,5,10] [--out DIR]

Rows: 1 process (both CFG branches in turn, as diffusers' WanPipeline runs them; it
uses both cores for intra-op parallelism), the same limited to one thread (the share of
one core a rank gets below), `--cfg-parallel` on 2 ranks (one core each), and `--hybrid` on 2
ranks for each k (segment 1 on the conditional text), plus k = 5 with the authors'
unconditional first segment. Columns: denoise wall time and its ratio to 1 process,
transformer block evaluations per rank (from the report), and PSNR / latent relative
error against the 1-process output (PSNR on frames decoded from the saved latents). At 50 steps the paper's SD3 defaults
apply unscaled (window 15, slope 5e-4, tau_cap 40).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import diffusers.utils.logging
import transformers.utils.logging
from safetensors.torch import load_file

from runtime.denoiser import Denoiser
from runtime.models.loading import load_components, resolve_placement
from runtime.models.registry import REGISTRY
from runtime.models.resolve import resolve_model
from runtime.quality import latent_rel_err, psnr


def run(exe: Path, out: Path, steps: int, extra: list[str], env: dict | None = None) -> dict:
    cmd = [
        str(exe),
        "generate",
        "--prompt",
        "a red circle moving left on a black background",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--device",
        "cpu",
        "--quiet",
        "--overwrite",
        "--save-latents",
        "--executor",
        "local",
        *extra,
    ]
    subprocess.run(cmd, check=True, env=None if env is None else {**os.environ, **env})
    return json.loads((out / "report.json").read_text())["items"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ks", default="3,5,10")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="ditango-hybrid-bench-"))
    exe = Path(sys.executable).with_name("ditango")
    configs = [
        ("1 process", "one", []),
        ("1 process, 1 thread", "one1", []),
        ("cfg-parallel (2)", "cfg", ["--gpus", "2", "--cfg-parallel"]),
    ]
    for k in [int(k) for k in args.ks.split(",")]:
        configs.append(
            (f"hybrid k={k} (2)", f"k{k}", ["--gpus", "2", "--cfg-parallel", "--hybrid", "--hybrid-k", str(k)])
        )
    configs.append(
        (
            "hybrid k=5, uncond segment 1 (2)",
            "k5u",
            ["--gpus", "2", "--cfg-parallel", "--hybrid", "--hybrid-k", "5", "--hybrid-first-text", "uncond"],
        )
    )
    one_thread = {"OMP_NUM_THREADS": "1"}  # the per-rank share of a 2-rank run: one core each
    items = {
        name: (run(exe, root / tag, args.steps, extra, one_thread if tag == "one1" else None), root / tag)
        for name, tag, extra in configs
    }
    base, base_dir = items["1 process"]
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    decoder = Denoiser(
        load_components(resolve_model("tiny-wan"), resolve_placement("cpu")), resolve_placement("cpu"), 32
    )
    base_latents = load_file(base_dir / base["latents"])["latents"]
    base_video = decoder.decode(base_latents)
    print(f"tiny-wan 128x128x17, {args.steps} steps, guidance 5.0, CPU (2 cores); outputs in {root}\n")
    one_thread_s = items["1 process, 1 thread"][0]["timing"]["denoise_s"]
    print(
        "| run | denoise (s) | speedup vs 1 process | vs 1 process, 1 thread | tau1..tau2 | block evals per rank "
        "| PSNR vs 1 process (dB) | latent rel err |"
    )
    print("|---|---:|---:|---:|---|---|---:|---:|")
    for name, (item, folder) in items.items():
        t = item["timing"]["denoise_s"]
        hybrid = item.get("hybrid") or {}
        window = f"{hybrid['tau1']}..{hybrid['tau2']}" if hybrid else "-"
        if hybrid:
            evals = " / ".join(str(sum(r)) for r in hybrid["block_evals"])
        else:
            branches = 2 if name.startswith("1 process") else 1
            evals = str(item["steps"] * branches * REGISTRY["tiny-wan"].layers)
        latents = load_file(folder / item["latents"])["latents"]
        video = decoder.decode(latents)  # decoded frames, not the MP4: H.264 noise would dominate
        p = psnr(video, base_video)
        print(
            f"| {name} | {t:.2f} | {base['timing']['denoise_s'] / t:.2f}x | {one_thread_s / t:.2f}x | {window} | {evals} "
            f"| {'inf' if p == float('inf') else f'{p:.2f}'} | {latent_rel_err(latents, base_latents):.2e} |"
        )


if __name__ == "__main__":
    main()
