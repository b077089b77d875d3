"""Quality of each strategy against exact attention, on the built-in model's prompt set.

    .venv/bin/python benchmarks/quality.py [--prompts 8] [--steps N] [--run NAME=ARGS ...]
                                           [--out FILE.md] [--keep DIR]

Generates the prompts (built from the training vocabulary, every colour, direction and
background) once with exact single-process attention and once per `--run` (ARGS are
`ditango generate` options, e.g. "ditango-0.4=--gpus-per-node 2 --nodes 2 --executor local
--parallel ditango --cache-ratio 0.4"). For every run it reports, against the exact videos,
PSNR and SSIM of the decoded frames and the relative error of the final latents, and for
every run (exact included) the prompt adherence the checker (tiny_wan/judge.py)
measures on the decoded frames: the share of prompts whose colour, motion direction and
background it finds as asked. Frames are decoded from the saved latents, not read back
from the MP4s, so video compression does not enter the numbers. Writes a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import bench  # noqa: E402
from runtime.quality import latent_rel_err, psnr, ssim  # noqa: E402
from tiny_wan.judge import judge  # noqa: E402

FOUR = "--gpus-per-node 2 --nodes 2 --executor local"
DEFAULT_RUNS = (
    f"ring-4={FOUR} --parallel ring",
    f"ditango-0.4={FOUR} --parallel ditango --reuse always --cache-ratio 0.4",
    f"ditango-0.8={FOUR} --parallel ditango --reuse always --cache-ratio 0.8",
    "hybrid-k5=--gpus-per-node 2 --executor local --cfg-parallel --hybrid --hybrid-k 5",
)
ASPECTS = ("colour", "direction", "background")


def generate(exe: Path, prompts: Path, out: Path, steps: int | None, extra: list[str]) -> dict[str, Path]:
    cmd = [
        str(exe),
        "generate",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--save-latents",
        "--quiet",
        "--device",
        "cpu",
        "--overwrite",
        *(["--steps", str(steps)] if steps else []),
        *extra,
    ]
    subprocess.run(cmd, check=True)
    report = json.loads((out / "report.json").read_text())
    return {item["id"]: out / item["latents"] for item in report["items"] if item["status"] == "done"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="default: the model's")
    ap.add_argument("--run", action="append", default=None, help="NAME=ARGS (repeatable); default: a set of four")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--keep", type=Path, default=None, help="generate under DIR (default: a temporary folder)")
    args = ap.parse_args()
    from safetensors.torch import load_file

    b = bench(args.prompts, args.keep, "ditango-quality-")
    root, specs, prompt_file, exe, denoiser = b.root, b.specs, b.prompt_file, b.exe, b.decoder
    runs = [("exact", [])] + [(r.split("=", 1)[0], r.split("=", 1)[1].split()) for r in (args.run or DEFAULT_RUNS)]

    decoded: dict[str, dict[str, tuple]] = {}
    for name, extra in runs:
        latents = generate(exe, prompt_file, root / name, args.steps, extra)
        decoded[name] = {}
        for item_id, path in latents.items():
            z = load_file(path)["latents"]
            decoded[name][item_id] = (z, denoiser.decode(z))

    lines = [
        f"Quality vs exact attention, `tiny-wan`, {args.prompts} prompts, "
        f"{args.steps or b.default_steps} steps. Adherence: share of prompts whose "
        "colour / direction / background the checker finds as asked (all: every one of them).",
        "",
        "| run | PSNR (dB) | SSIM | latent rel err | colour | direction | background | all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    exact = decoded["exact"]
    for name, _ in runs:
        rows = decoded[name]
        hits = {a: 0 for a in (*ASPECTS, "all")}
        quality = []
        for item_id, (z, frames) in rows.items():
            verdict = judge(frames).matches(specs[item_id])
            for a in ASPECTS:
                hits[a] += verdict[a]
            hits["all"] += all(verdict[a] for a in ASPECTS)
            if name != "exact" and item_id in exact:
                ref_z, ref_frames = exact[item_id]
                quality.append((psnr(frames, ref_frames), ssim(frames, ref_frames), latent_rel_err(z, ref_z)))
        n = max(1, len(rows))
        if quality:
            q = np.asarray(quality, dtype=np.float64)
            finite = q[:, 0][np.isfinite(q[:, 0])]
            p = f"{finite.mean():.1f}" if len(finite) else "inf"
            cells = [p, f"{q[:, 1].mean():.4f}", f"{q[:, 2].mean():.1e}"]
        else:
            cells = ["=", "=", "0"]
        share = [f"{hits[a] / n:.0%}" for a in (*ASPECTS, "all")]
        lines.append(f"| {name} | " + " | ".join(cells + share) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
