"""DiTango vs exact ring on the built-in model, 4 ranks over 2 virtual nodes.

    .venv/bin/python benchmarks/ditango.py [--steps 20] [--ratios 0,0.2,0.4,0.6,0.8] [--out DIR]

For each cache ratio, runs `ditango generate --parallel ditango --reference exact` (the
exact ring path runs too, for quality) and reads the item's report: bytes per link
class summed over ranks, the computed fraction of remote attention on selective steps,
latent relative error / PSNR / SSIM against the exact run, and denoise wall time. A
ring row gives the exact baseline's bytes and time. "computed (selective steps)" is the
report's computed_fraction; "(all steps)" also counts warm-up, anchor and cool-down steps,
where everything is computed. Defaults: warm-up 5, cool-down 5,
group size 2 (one group per virtual node). On a 2-core CPU, 4 ranks oversubscribe the
cores: wall times show overheads, not GPU-cluster scaling; bytes are exact anywhere.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(exe: Path, out: Path, args, extra: list[str]) -> dict:
    cmd = [
        str(exe), "generate", "--prompt", "a red circle moving left on a black background", "--out", str(out),
        "--steps", str(args.steps), "--device", "cpu", "--quiet", "--overwrite", "--executor", "local",
        "--gpus-per-node", "2", "--nodes", "2", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads((out / "report.json").read_text())["items"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ratios", default="0,0.2,0.4,0.6,0.8")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="ditango-bench-"))
    exe = Path(sys.executable).with_name("ditango")
    rows = []
    ring = run(exe, root / "ring", args, ["--parallel", "ring"])
    rows.append(("ring (exact)", ring, None))
    for ratio in [float(r) for r in args.ratios.split(",")]:
        item = run(exe, root / f"ditango-{ratio}", args, ["--parallel", "ditango", "--cache-ratio", str(ratio),
                                                           "--reference", "exact"])  # fmt: skip
        rows.append((f"ditango {ratio:g}", item, item["quality"]))
    print(f"tiny-wan 128x128x17 (320 tokens), {args.steps} steps, 4 ranks = 2 virtual nodes x 2, CPU gloo\n")
    print(
        "| run | inter-node MB | intra-node MB | computed (selective steps) | computed (all steps) "
        "| latent rel err | PSNR (dB) | SSIM | denoise (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, item, q in rows:
        comm, att = item["comm"], item["attention"]
        per_step = att.get("per_step", [1.0])
        all_steps = sum(per_step) / len(per_step)
        if q is None:
            err = psnr = ssim = "-"
        else:
            err = f"{q['latent_rel_err']:.2e}"
            psnr = "inf" if q["psnr"] is None else f"{q['psnr']:.2f}"
            ssim = f"{q['ssim']:.4f}"
        print(
            f"| {name} | {comm['inter_node_bytes'] / 1e6:.2f} | {comm['intra_node_bytes'] / 1e6:.2f} "
            f"| {att['computed_fraction']:.3f} | {all_steps:.3f} | {err} | {psnr} | {ssim} "
            f"| {item['timing']['denoise_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
