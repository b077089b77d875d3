"""The fidelity comparison: exact strategies, DiTango, and diffusers' step caches side by side.

    .venv/bin/python benchmarks/fidelity.py [--steps 50] [--prompts 8] [--out DIR] [--fresh]
        [--only NAME,...] [--table FILE.md] [--json FILE] [--plots DIR]

On the built-in model (`tiny-wan`), 4 ranks on 2 virtual nodes (`--nodes 2 --gpus-per-node
2`), CPU gloo, the first N prompts of `tiny_wan.data.eval_prompts` are generated once per row
(ROWS below): the exact strategies (ring, Ulysses, TP), DiTango (the hpdc and budget planners
at two cache ratios each, default group = a node), each step cache at two settings over the
exact ring, and DiTango with first-block cache. Every run saves its final latents; frames are
decoded from them in this process (one process, untiled), so every row is compared with the
ring's decoded the same way and MP4 compression does not enter the numbers. Runs whose
report is complete under --out are reused (--fresh reruns them); --only runs just those rows.

Columns (sums and means over the prompts):
- PSNR / SSIM: decoded frames vs the exact ring's (mean, min); latent err: ||x - x_ring|| /
  ||x_ring|| of the final latents, mean;
- colour / direction / background: the share of prompts the judge (tiny_wan/judge.py) finds
  as asked;
- attention computed: self-attention work done over what an exact run does: the fraction of
  self-attention evaluations that ran (a step cache skips some) x the fraction of the KV each
  ran over fresh (DiTango reuses the rest from its cache);
- blocks run: the fraction of block evaluations that ran (their FFN ran);
- inter-node / intra-node: bytes vs the ring's over the same prompts;
- denoise time: denoising wall time vs the ring's in this invocation; on a small CPU the 4
  ranks oversubscribe the cores, so it shows compute saved, not cluster speed.

Then every row is priced for Wan2.1-14B at 720p on 4 nodes x 8 H20 (`ditango simulate`, its
default profile): the row's strategy (and for DiTango its cache ratio and planner) as
`simulate` prices it; a step cache scales the strategy's per-step time by the fractions
measured here (a skipped block computes nothing; a skipped attention costs no attention time)
and its bytes by the attention evaluations that ran (by the blocks run under TP).

Writes the markdown table to stdout (and --table), the rows to --json, and two plots under
--plots (default DIR): PSNR vs inter-node bytes, and PSNR vs attention computed.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ditango import ASPECTS, MODEL, Config, fmt, mean  # noqa: E402
from benchmarks.harness import bench  # noqa: E402
from planner.strategy import strategy_named
from runtime.plots import Series, write_xy_plot  # noqa: E402
from runtime.quality import psnr, ssim  # noqa: E402
from tiny_wan.judge import judge  # noqa: E402

LAYOUT = ["--gpus-per-node", "2", "--nodes", "2"]
RING = ["--parallel", "ring"]
# (name, family, generate options after the layout)
ROWS: list[tuple[str, str, list[str]]] = [
    ("ring", "exact", RING),
    ("ulysses", "exact", ["--parallel", "ulysses"]),
    ("tp", "exact", ["--parallel", "tp"]),
    ("ditango hpdc 0.4", "ditango", ["--parallel", "ditango", "--reuse", "always", "--cache-ratio", "0.4"]),
    ("ditango hpdc 0.8", "ditango", ["--parallel", "ditango", "--reuse", "always", "--cache-ratio", "0.8"]),
    ("ditango budget 0.7", "ditango", ["--parallel", "ditango", "--reuse", "always", "--planner", "budget", "--cache-ratio", "0.7"]),
    ("ditango budget 0.8", "ditango", ["--parallel", "ditango", "--reuse", "always", "--planner", "budget", "--cache-ratio", "0.8"]),
    ("first-block 0.05", "step cache", [*RING, "--step-cache", "first-block:threshold=0.05"]),
    ("first-block 0.1", "step cache", [*RING, "--step-cache", "first-block:threshold=0.1"]),
    ("pab 2", "step cache", [*RING, "--step-cache", "pab:spatial_attention_block_skip_range=2"]),
    ("pab 3", "step cache", [*RING, "--step-cache", "pab:spatial_attention_block_skip_range=3"]),
    ("taylorseer 3", "step cache", [*RING, "--step-cache", "taylorseer:cache_interval=3"]),
    ("taylorseer 5", "step cache", [*RING, "--step-cache", "taylorseer:cache_interval=5"]),
    ("magcache 0.06", "step cache", [*RING, "--step-cache", "magcache:threshold=0.06"]),
    ("magcache 0.12", "step cache", [*RING, "--step-cache", "magcache:threshold=0.12"]),
    ("ditango hpdc 0.4 + first-block 0.05", "ditango + step cache",
     ["--parallel", "ditango", "--reuse", "always", "--cache-ratio", "0.4", "--step-cache", "first-block:threshold=0.05"]),
]  # fmt: skip


def run(exe: Path, prompts: Path, out: Path, steps: int, args: list[str], fresh: bool) -> tuple[dict | None, str]:
    """(report or None, why not); a complete report under `out` is reused unless `fresh`."""
    report_path, args_path = out / "report.json", out / "bench_args.json"
    asked = {"steps": steps, "args": [*LAYOUT, *args], "prompts": prompts.read_text()}
    if report_path.exists() and not fresh and args_path.exists() and json.loads(args_path.read_text()) == asked:
        report = json.loads(report_path.read_text())
        if report["counts"]["done"] == len(report["items"]):
            return report, "reused"
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
        *args,
    ]
    report_path.unlink(missing_ok=True)
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=f).returncode
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    args_path.write_text(json.dumps(asked))
    if rc != 0 or report is None or report["counts"]["done"] != len(report["items"]):
        tail = next((line for line in reversed(log.read_text().splitlines()) if line.strip()), "")
        return None, f"exit {rc}: {tail} (log: {log})"
    return report, "ran"


def fractions(item: dict) -> tuple[float, float]:
    """(attention computed, blocks run) of one item, from its report record."""
    cache = item.get("step_cache") or {}
    kv = (item.get("attention") or {}).get("kv_fraction_per_evaluation") or 1.0
    return cache.get("attention_fraction", 1.0) * kv, cache.get("block_fraction", 1.0)


def measure(name: str, family: str, report: dict, frames: dict, latents: dict, ring: dict, specs: dict) -> dict:
    items = {i["id"]: i for i in report["items"]}
    hits = {a: 0 for a in ASPECTS}
    psnrs, ssims, errs = [], [], []
    for item_id in items:
        verdict = judge(frames[item_id]).matches(specs[item_id])
        for a in ASPECTS:
            hits[a] += verdict[a]
        if name != "ring":
            ref_item, ref_frames, ref_latents = ring[item_id]
            psnrs.append(psnr(frames[item_id], ref_frames))
            ssims.append(ssim(frames[item_id], ref_frames))
            errs.append(float((latents[item_id] - ref_latents).norm() / ref_latents.norm()))
    finite = [p for p in psnrs if math.isfinite(p)]
    ring_items = [ring[i][0] for i in items]

    def vs_ring(key: str) -> float | None:
        base = sum(i["comm"][key] for i in ring_items)
        return sum(i["comm"][key] for i in items.values()) / base if base else None

    attn, blocks = zip(*(fractions(i) for i in items.values()), strict=True)
    evals = [(i.get("step_cache") or {}).get("attention_fraction", 1.0) for i in items.values()]
    return {
        "run": name,
        "family": family,
        "psnr_mean": mean(finite),
        "psnr_min": min(finite) if finite else None,
        "psnr_inf": len(psnrs) - len(finite),
        "ssim_mean": mean(ssims),
        "latent_err_mean": mean(errs),
        "adherence": {a: hits[a] / len(items) for a in ASPECTS},
        "attention_computed": mean(list(attn)),
        "blocks_run": mean(list(blocks)),
        "attention_evals": mean(evals),  # self-attention evaluations that ran (a step cache skips some)
        "inter_node_vs_ring": vs_ring("inter_node_bytes"),
        "intra_node_vs_ring": vs_ring("intra_node_bytes"),
        "inter_node_bytes": sum(i["comm"]["inter_node_bytes"] for i in items.values()),
        "intra_node_bytes": sum(i["comm"]["intra_node_bytes"] for i in items.values()),
        "denoise_s": sum(i["timing"]["denoise_s"] for i in items.values()),
        "options": report.get("options", {}),
    }


def simulate(exe: Path, row: dict, args: list[str], steps: int) -> dict | None:
    """The row priced for Wan2.1-14B, 720p, 4 x 8 H20 (`ditango simulate`'s defaults)."""
    strategy = args[args.index("--parallel") + 1]
    cmd = [
        str(exe),
        "simulate",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--parallel",
        strategy,
        "--steps",
        str(steps),
        "--json",
    ]
    if strategy_named(strategy).reuses:
        for flag in ("--cache-ratio", "--planner"):
            if flag in args:
                cmd += [flag, args[args.index(flag) + 1]]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"simulate {row['run']}: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    rows = [r for r in json.loads(out.stdout)["rows"] if r["strategy"] == strategy and r["nodes"] == 4]
    if not rows:
        return None
    # A skipped block costs nothing; a skipped attention (PAB, TaylorSeer) costs no attention
    # time and, under context parallelism, none of its bytes (they are the attention's).
    r, blocks, evals = rows[0], row["blocks_run"], row["attention_evals"]
    step = (r["step_s"] - r["attention_s"]) * blocks + r["attention_s"] * evals
    moved = blocks if strategy_named(strategy).splits_weights else evals
    return {
        "e2e_s": r["e2e_s"] - steps * (r["step_s"] - step),
        "step_s": step,
        "inter_node_bytes": r["inter_node_bytes"] * moved,
        "intra_node_bytes": r["intra_node_bytes"] * moved,
    }


def psnr_text(row: dict) -> list[str]:
    if row["run"] == "ring":
        return ["ref", "ref"]
    if row["psnr_mean"] is None:
        return ["inf", "inf"]
    note = f" ({row['psnr_inf']} inf)" if row["psnr_inf"] else ""
    return [f"{row['psnr_mean']:.2f}{note}", f"{row['psnr_min']:.2f}"]


def table(rows: list[dict], header: str) -> str:
    ring_s = rows[0].get("denoise_s") or math.nan
    ring_sim = rows[0].get("sim") or {}
    lines = [
        header,
        "",
        "| run | family | PSNR mean (dB) | PSNR min (dB) | SSIM mean | latent err | colour | direction | background "
        "| attention computed | blocks run | inter-node vs ring | intra-node vs ring | denoise time vs ring "
        "| 14B 4x8 H20: e2e (s) | speed-up vs ring |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['run']} | {row['family']} | failed: {row['error']} |" + " - |" * 14)
            continue
        sim = row.get("sim") or {}
        speedup = ring_sim["e2e_s"] / sim["e2e_s"] if sim and ring_sim else None
        cells = [
            row["family"],
            *psnr_text(row),
            "ref" if row["run"] == "ring" else fmt(row["ssim_mean"], ".4f"),
            "ref" if row["run"] == "ring" else fmt(row["latent_err_mean"], ".4f"),
            *[f"{row['adherence'][a]:.0%}" for a in ASPECTS],
            fmt(row["attention_computed"], ".3f"),
            fmt(row["blocks_run"], ".3f"),
            fmt(row["inter_node_vs_ring"], ".3f"),
            fmt(row["intra_node_vs_ring"], ".3f"),
            f"{row['denoise_s'] / ring_s:.2f}",
            fmt(sim.get("e2e_s"), ".1f"),
            fmt(speedup, ".2f"),
        ]
        lines.append(f"| {row['run']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(folder: Path, rows: list[dict]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    done = [r for r in rows[1:] if not r.get("error")]
    written = []
    for x_key, x_label, name in (
        ("inter_node_vs_ring", "inter-node bytes vs ring", "fidelity_psnr_vs_bytes.png"),
        ("attention_computed", "attention computed vs exact", "fidelity_psnr_vs_compute.png"),
    ):
        series = []
        for family in ("exact", "ditango", "step cache", "ditango + step cache"):
            pts = [
                (r[x_key], math.inf if r["psnr_mean"] is None else r["psnr_mean"], r["run"])
                for r in done
                if r["family"] == family and r[x_key] is not None
            ]
            if pts:
                series.append(Series(family, pts, joined=False, marker="square" if family != "exact" else "cross"))
        path = folder / name
        write_xy_plot(
            path,
            series,
            hline=40.0,
            x_range=(0.0, 1.05),
            x_label=x_label,
            y_label="mean PSNR (dB)",
            title=f"quality vs {x_label} (tiny-wan, 8 prompts; top: identical)",
        )
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8, help="the first N of eval_prompts")
    ap.add_argument("--out", type=Path, default=None, metavar="DIR", help="keep the runs here [a temporary folder]")
    ap.add_argument("--fresh", action="store_true", help="rerun rows whose reports exist under --out")
    ap.add_argument("--only", default="", help="comma-separated row names to run (the ring always runs)")
    ap.add_argument("--table", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plots", type=Path, default=None, metavar="DIR")
    args = ap.parse_args()
    if args.steps < 1 or args.prompts < 1:
        ap.error(f"--steps and --prompts must be at least 1, got {args.steps} and {args.prompts}")
    names = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = names - {name for name, _, _ in ROWS}
    if unknown:
        ap.error(f"--only: unknown rows {sorted(unknown)}; rows: {[name for name, _, _ in ROWS]}")
    chosen = [r for r in ROWS if not names or r[0] in names or r[0] == "ring"]
    b = bench(args.prompts, args.out, "ditango-fidelity-", MODEL)
    root, specs, prompt_file, exe, denoiser = b.root, b.specs, b.prompt_file, b.exe, b.decoder

    rows, ring = [], {}
    for k, (name, family, run_args) in enumerate(chosen):
        cfg = Config(name, name.replace(" ", "-").replace("+", "and"), run_args)
        out = root / cfg.folder
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        report, how = run(exe, prompt_file, out, args.steps, run_args, args.fresh)
        print(f"[{k + 1}/{len(chosen)}] {name}: {how} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        if report is None:
            rows.append({"run": name, "family": family, "error": how})
            continue
        latents = {i["id"]: load_file(out / i["latents"])["latents"] for i in report["items"]}
        frames = {i: denoiser.decode(x) for i, x in latents.items()}
        if name == "ring":
            ring = {i["id"]: (i, frames[i["id"]], latents[i["id"]]) for i in report["items"]}
        elif not ring:
            rows.append({"run": name, "family": family, "error": "no exact ring run to compare with"})
            continue
        row = measure(name, family, report, frames, latents, ring, specs)
        row["sim"] = simulate(exe, row, run_args, 50)
        rows.append(row)
    header = (
        f"`{MODEL}`, {args.steps} steps, 4 ranks on 2 virtual nodes (2 a node; DiTango's group = a node), "
        f"{args.prompts} prompts (eval_prompts), CPU gloo; every row vs the exact ring of the same prompts. The last "
        "two columns are modelled (`ditango simulate`, Wan2.1-14B 720p 81 frames 50 steps, 4 nodes x 8 H20; a step "
        "cache scales its strategy's step time by the blocks and attention evaluations run)."
    )
    text = table(rows, header)
    print(text)
    if args.table:
        args.table.write_text(text + "\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"schema": 1, "steps": args.steps, "prompts": args.prompts, "rows": rows},
                indent=2,
                allow_nan=False,
                default=float,
            )
            + "\n"
        )
    for path in plots(args.plots or root, rows):
        print(f"plot {path}", file=sys.stderr)
    print(f"runs in {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
