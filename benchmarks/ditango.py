"""DiTango's two planners over cache ratios vs the exact ring: bytes against quality.

    .venv/bin/python benchmarks/ditango.py [--steps 50] [--prompts 8]
        [--hpdc-ratios 0.2,0.4,0.6,0.8] [--budget-ratios 0.6,0.7,0.8,0.85,0.9]
        [--extra "--tau-max 8"] [--run NAME=ARGS ...] [--out DIR] [--table FILE.md]
        [--plot FILE.png] [--json FILE]

On the built-in model (`tiny-wan`) with 4 ranks on 4 virtual nodes (`--gpus-per-node 1
--nodes 4`, DiTango `--group-size 1`), CPU gloo, it generates the first N prompts of
`tiny_wan.data.eval_prompts` once with the exact ring (`--parallel ring`) and once per
DiTango configuration: every `--hpdc-ratios` value with `--planner hpdc`, every
`--budget-ratios` value with `--planner budget`, then every `--run` (NAME=ARGS: any
`generate` options, e.g. "target40=--target-psnr 40"). `--extra` is appended to every
DiTango run (not to the ring); an empty ratio list skips that planner. Every run saves its
final latents; frames are decoded from them in this process (one process, untiled), so
DiTango is compared with the saved ring run, decoded the same way, and MP4 compression
does not enter the numbers. The runs are kept under --out (default: a temporary folder).

One row per run, the ring first:
- planner, cache ratio: as run (a `--run` row: as its report says, e.g. the ratio
  `--target-psnr` chose);
- inter-node vs ring: inter-node bytes summed over the prompts, over the ring's for the
  same prompts (the ring's MB are in the header line);
- computed (all steps): computed attention cells / all cells over every step, mean over
  prompts; it counts the warm-up, anchor and cool-down steps, where everything is
  computed, and it is what the bytes follow;
- anchors / item: anchor steps per prompt, mean;
- PSNR, SSIM: decoded frames vs the ring's, mean and min over prompts; "inf" where the
  frames are identical (a mean over the other prompts notes how many were);
- colour, direction, background: prompt adherence, the share of prompts whose colour,
  motion direction and background the judge (tiny_wan/judge.py) finds as asked;
- denoise (s): denoising wall time summed over prompts.
A run that fails is reported on stderr and marked failed in its row; the others go on.
Bytes are exact counts anywhere; on a small CPU the 4 ranks oversubscribe the cores, so
times show overheads, not cluster speed.

Writes the markdown table to stdout (and --table), the rows to --json, and a plot of mean
PSNR against inter-node bytes vs ring, one line per planner and a marker per `--run`, with
a dashed line at 40 dB (--plot, default DIR/bytes_vs_psnr.png).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import bench  # noqa: E402
from runtime.plots import Series, write_xy_plot  # noqa: E402
from runtime.quality import psnr, ssim  # noqa: E402
from tiny_wan.judge import judge  # noqa: E402

MODEL = "tiny-wan"
LAYOUT = ["--gpus-per-node", "1", "--nodes", "4"]
# The method itself at the built-in model's size, where its bookkeeping outweighs the attention saved.
DITANGO = ["--parallel", "ditango", "--group-size", "1", "--reuse", "always"]
ASPECTS = ("colour", "direction", "background")
TARGET_DB = 40.0  # the plot's reference line


@dataclass(frozen=True)
class Config:
    name: str
    folder: str  # under --out
    args: list[str]  # generate options after the layout
    planner: str | None = None  # None: read from the report (ring, --run)
    ratio: float | None = None


def ratios(text: str, flag: str, ap: argparse.ArgumentParser) -> list[float]:
    try:
        values = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        ap.error(f"{flag} takes comma-separated numbers in [0, 1), e.g. 0.4,0.8; got {text!r}")
    if any(not 0.0 <= v < 1.0 for v in values):
        ap.error(f"{flag}: cache ratios are in [0, 1) (0 = exact attention), got {text!r}")
    return values


def configs(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[Config]:
    extra = shlex.split(args.extra)
    out = [Config("ring (exact)", "ring", ["--parallel", "ring"])]
    sweeps = {"hpdc": (args.hpdc_ratios, "--hpdc-ratios"), "budget": (args.budget_ratios, "--budget-ratios")}
    for planner, (text, flag) in sweeps.items():
        for r in ratios(text, flag, ap):
            run_args = [*DITANGO, "--planner", planner, "--cache-ratio", str(r), *extra]
            out.append(Config(f"{planner} {r:g}", f"{planner}-{r:g}", run_args, planner, r))
    for spec in args.run or ():
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip():
            ap.error(f"--run takes NAME=ARGS, e.g. 'target40=--target-psnr 40'; got {spec!r}")
        folder = "run-" + re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip())
        out.append(Config(name.strip(), folder, [*DITANGO, *extra, *shlex.split(rest)]))
    folders = [c.folder for c in out]
    if len(set(folders)) != len(folders):
        ap.error(f"runs need different names (and ratios): {[c.name for c in out]}")
    return out


def generate(exe: Path, prompts: Path, out: Path, steps: int, cfg: Config) -> tuple[dict | None, str | None]:
    """(report, None) when the run wrote one with at least one item done, else (None, why);
    the command and its stderr go to <out>.log beside the run's folder."""
    cmd = [
        str(exe),
        "generate",
        "--model",
        MODEL,
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--device",
        "cpu",
        "--executor",
        "local",
        "--save-latents",
        "--quiet",
        "--overwrite",
        *LAYOUT,
        *cfg.args,
    ]
    (out / "report.json").unlink(missing_ok=True)  # never read a report left by an earlier invocation
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=f).returncode
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    done = [i for i in (report or {}).get("items", []) if i.get("status") == "done"]
    tail = next((line for line in reversed(log.read_text().splitlines()) if line.strip()), "")
    if rc != 0 or not done:
        why = f"exit {rc}" + (f": {tail}" if tail else "") + f" (log: {log})"
        if not done:
            return None, why
        print(f"run {cfg.name}: {len(done)} of {len(report['items'])} items done; {why}", file=sys.stderr)
    return report, None


def mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def measure(cfg: Config, report: dict, frames: dict, ring: dict | None, specs: dict, reference: bool) -> dict:
    """One row from a finished run: `frames` maps each done item's id to its decoded frames
    (uint8 [F, H, W, 3]), `ring` maps item id -> (item record, frames) of the exact run;
    `reference`: this is that run (no PSNR / SSIM against itself)."""
    items = {i["id"]: i for i in report["items"] if i.get("status") == "done"}
    first = next(iter(items.values()))
    attention = first.get("attention") or {}
    ratio = cfg.ratio
    if ratio is None and attention.get("steps") is not None:  # a DiTango --run row: as its report says
        ratio = attention.get("cache_ratio", (report.get("calibration") or {}).get("cache_ratio"))
        ratio = report.get("options", {}).get("cache_ratio") if ratio is None else ratio
    hits = {a: 0 for a in (*ASPECTS, "all")}
    psnrs, ssims = [], []
    for item_id in items:
        verdict = judge(frames[item_id]).matches(specs[item_id])
        for a in ASPECTS:
            hits[a] += verdict[a]
        hits["all"] += all(verdict[a] for a in ASPECTS)
        if ring is not None and item_id in ring and not reference:
            ref = ring[item_id][1]
            psnrs.append(psnr(frames[item_id], ref))
            ssims.append(ssim(frames[item_id], ref))
    common = [i for i in items if ring is not None and i in ring]
    ring_bytes = sum(ring[i][0]["comm"]["inter_node_bytes"] for i in common) if common else 0
    finite = [p for p in psnrs if math.isfinite(p)]
    per = [i.get("attention") or {} for i in items.values()]
    return {
        "run": cfg.name,
        "status": "done" if len(items) == len(report["items"]) else "partial",
        "items": len(items),
        "items_total": len(report["items"]),
        "planner": cfg.planner or attention.get("planner"),
        "cache_ratio": ratio,
        "args": cfg.args,
        "inter_node_bytes": sum(i["comm"]["inter_node_bytes"] for i in items.values()),
        "intra_node_bytes": sum(i["comm"]["intra_node_bytes"] for i in items.values()),
        "inter_node_vs_ring": (sum(items[i]["comm"]["inter_node_bytes"] for i in common) / ring_bytes)
        if ring_bytes
        else None,
        "computed_fraction_all_steps": mean([a.get("computed_fraction_all_steps", 1.0) for a in per]),
        "computed_fraction_selective": mean(
            [a["computed_fraction_selective"] for a in per if a.get("computed_fraction_selective") is not None]
        ),
        "anchors_per_item": mean([a["steps"]["anchor"] for a in per if "steps" in a]),
        # None where every prompt is identical to the ring's (PSNR +inf); psnr_inf counts those prompts.
        "psnr_mean": mean(finite),
        "psnr_min": min(finite) if finite else None,  # identical prompts (inf) never lower the min
        "psnr_inf": len(psnrs) - len(finite),
        "ssim_mean": mean(ssims),
        "ssim_min": min(ssims) if ssims else None,
        "adherence": {a: hits[a] / len(items) for a in hits},
        "denoise_s": sum(i["timing"]["denoise_s"] for i in items.values()),
        "error": None,
    }


def failed_row(cfg: Config, why: str) -> dict:
    return {
        "run": cfg.name,
        "status": "failed",
        "planner": cfg.planner,
        "cache_ratio": cfg.ratio,
        "args": cfg.args,
        "error": why,
    }


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def psnr_cells(row: dict, reference: bool) -> list[str]:
    if reference:
        return ["ref", "ref"]
    if row["psnr_mean"] is None:
        return ["inf", "inf"] if row["psnr_inf"] else ["-", "-"]
    note = f" ({row['psnr_inf']} inf)" if row["psnr_inf"] else ""  # the mean is over the other prompts
    return [f"{row['psnr_mean']:.2f}{note}", f"{row['psnr_min']:.2f}"]


def table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| run | planner | cache ratio | inter-node vs ring | computed (all steps) | anchors / item "
        "| PSNR mean (dB) | PSNR min (dB) | SSIM mean | SSIM min | colour | direction | background | denoise (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, row in enumerate(rows):
        name = row["run"]
        if row["status"] == "partial":
            name += f" ({row['items']} of {row['items_total']} items)"
        if row["status"] == "failed":
            cells = [fmt(row["planner"], ""), fmt(row["cache_ratio"], "g")] + ["failed"] + ["-"] * 10
        else:
            adherence = [f"{row['adherence'][a]:.0%}" for a in ASPECTS]
            cells = [
                fmt(row["planner"], ""),
                fmt(row["cache_ratio"], "g"),
                fmt(row["inter_node_vs_ring"], ".3f"),
                fmt(row["computed_fraction_all_steps"], ".3f"),
                fmt(row["anchors_per_item"], ".1f"),
                *psnr_cells(row, k == 0),
                *(["ref", "ref"] if k == 0 else [fmt(row["ssim_mean"], ".4f"), fmt(row["ssim_min"], ".4f")]),
                *adherence,
                f"{row['denoise_s']:.1f}",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, rows: list[dict]) -> None:
    def point(row: dict, label: str) -> tuple[float, float, str] | None:
        if row["status"] == "failed" or row["inter_node_vs_ring"] is None:
            return None
        if row["psnr_mean"] is None and not row["psnr_inf"]:
            return None
        y = math.inf if row["psnr_mean"] is None else row["psnr_mean"]
        return row["inter_node_vs_ring"], y, label + (" inf" if math.isinf(y) else "")

    series = []
    for planner in ("hpdc", "budget"):
        pts = [point(r, f"{r['cache_ratio']:g}") for r in rows[1:] if r.get("sweep") == planner]
        if pts := [p for p in pts if p is not None]:
            series.append(Series(planner, pts))
    runs = [point(r, r["run"]) for r in rows[1:] if r.get("sweep") is None]
    if runs := [p for p in runs if p is not None]:
        series.append(Series("runs", runs, joined=False, marker="cross"))
    path.parent.mkdir(parents=True, exist_ok=True)
    axes = {
        "x_label": "inter-node bytes vs ring",
        "y_label": "mean PSNR (dB)",
        "title": "DiTango: quality vs inter-node bytes (labels: cache ratio)",
    }
    write_xy_plot(path, series, hline=TARGET_DB, x_range=(0.0, 1.05), **axes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8, help="the first N of eval_prompts")
    ap.add_argument("--hpdc-ratios", default="0.2,0.4,0.6,0.8", help="cache ratios for --planner hpdc ('' for none)")
    ap.add_argument("--budget-ratios", default="0.6,0.7,0.8,0.85,0.9", help="cache ratios for --planner budget")
    ap.add_argument(
        "--extra",
        default="",
        help='generate options added to every DiTango run, e.g. "--tau-max 8" (one flag: --extra=--alpha)',
    )
    ap.add_argument("--run", action="append", metavar="NAME=ARGS", help="an extra DiTango run (repeatable)")
    ap.add_argument("--out", type=Path, default=None, metavar="DIR", help="keep the runs here [a temporary folder]")
    ap.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--plot", type=Path, default=None, help="bytes vs PSNR PNG (default: DIR/bytes_vs_psnr.png)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if args.steps < 1 or args.prompts < 1:
        ap.error(f"--steps and --prompts must be at least 1, got {args.steps} and {args.prompts}")
    runs = configs(args, ap)
    b = bench(args.prompts, args.out, "ditango-bench-", MODEL)
    root, specs, prompt_file, exe, denoiser = b.root, b.specs, b.prompt_file, b.exe, b.decoder

    rows: list[dict] = []
    ring: dict | None = None
    for k, cfg in enumerate(runs):
        out = root / cfg.folder
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        print(f"[{k + 1}/{len(runs)}] {cfg.name}: {shlex.join(cfg.args)}", file=sys.stderr, flush=True)
        report, why = generate(exe, prompt_file, out, args.steps, cfg)
        if report is None:
            print(f"run {cfg.name} failed: {why}", file=sys.stderr, flush=True)
            rows.append(failed_row(cfg, why))
            continue
        done = [i for i in report["items"] if i.get("status") == "done"]
        frames = {i["id"]: denoiser.decode(load_file(out / i["latents"])["latents"]) for i in done}
        if k == 0:
            ring = {i["id"]: (i, frames[i["id"]]) for i in done}
        row = measure(cfg, report, frames, ring, specs, reference=k == 0)
        rows.append(row)
        print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    for cfg, row in zip(runs, rows, strict=True):
        row["sweep"] = cfg.planner  # hpdc / budget for the sweeps, None for the ring and --run rows

    ring_row = rows[0]
    ring_mb = "-" if ring_row["status"] == "failed" else f"{ring_row['inter_node_bytes'] / 1e6:.2f}"
    header = (
        f"`{MODEL}`, {args.steps} steps, 4 ranks on 4 virtual nodes (1 rank a node, DiTango group size 1), "
        f"{args.prompts} prompts (eval_prompts), CPU gloo"
        + (f"; DiTango runs add `{args.extra}`" if args.extra.strip() else "")
        + f". Bytes are exact counts (ring: {ring_mb} MB inter-node over the prompts); times on a "
        f"{os.cpu_count()}-core CPU show overheads, not cluster speed. PSNR / SSIM: decoded frames vs the "
        "exact ring's; colour / direction / background: share of prompts the judge finds as asked."
    )
    text = table(rows, header)
    print(text)
    if args.table:
        args.table.write_text(text + "\n")
    if args.json:
        doc = {
            "schema": 1,
            "model": MODEL,
            "steps": args.steps,
            "layout": "4 ranks on 4 virtual nodes, group size 1",
            "prompts": args.prompts,
            "extra": args.extra,
            "out": str(root),
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    plot_path = args.plot or root / "bytes_vs_psnr.png"
    plot(plot_path, rows)
    print(f"\nruns in {root}; plot {plot_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
