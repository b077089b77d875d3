"""`--quantize fp8` and `--compile` on the CPU: what fp8 costs in quality, and what compiling
the blocks changes in the latents and in the time per step.

    .venv/bin/python benchmarks/precision.py [--steps 50] [--prompts 8] [--rounds 3] [--timed-steps 4]
        [--wide-frames 5] [--wide-forwards 5] [--table FILE.md] [--json FILE]

Everything runs in this one process through the Python API (not the CLI): the same calls
`ditango generate` makes for one process (`Denoiser.encode_text`, `initial_latents`,
`denoise`, `decode`), with `runtime/quantize.py quantize_transformers` for fp8 and
`runtime/compile.py compile_blocks` (torch.compile, inductor) for the compiled runs. CPU,
float32 (the CPU default), torch threads = the cores this process may use.

1. Quality, on the built-in model (`tiny-wan`), the first N prompts of
   `tiny_wan.data.eval_prompts` (the fidelity prompts), seed 0, the model's height, width,
   frames, guidance and negative prompt, `--steps` steps (50, as benchmarks/fidelity.py; the
   model's own default is 25). Per prompt: the float32 eager run is the reference; the fp8
   run (a second copy of the model, its blocks' Linears in float8 e4m3, as `--quantize fp8`)
   is compared with it as `--reference exact` compares: PSNR and SSIM of the decoded frames
   (one decoder, untiled; runtime/quality.py) and the latent relative error; then the
   float32 model with its blocks compiled runs the same prompt, and its final latents are
   compared with the eager ones (max abs difference, relative L2). Last rows: the mean and the
   worst over the prompts (min PSNR / SSIM, max errors).
2. Speed, measured side by side in this invocation: fp32 eager, fp32 compiled, fp8 eager, fp8
   compiled, each its own freshly loaded model, dynamo reset before each compiled one's first
   call. The variants take turns (round robin), so a load that comes and goes on a shared
   machine falls on all four alike:
   (a) `tiny-wan` at its default size (64x64, 17 frames: 320 tokens, 4 blocks), the first
       prompt, `--rounds` runs per variant of `--timed-steps` steps (a schedule that long);
       ms per denoising step (both CFG branches and the scheduler step);
   (b) Wan2.1-1.3B's widths (runtime/models/wan/models.py WAN21_1_3B: 12 heads x
       128 = 1536 wide, FFN 8960, text_dim 4096) with 2 blocks instead of 30, random weights
       (seed 0), diffusers' WanTransformer3DModel called directly on latents
       [1, 16, --wide-frames, 30, 52] (5 frames: 1,950 tokens) and 512 text tokens, one
       forward per step (one CFG branch), `--wide-forwards` forwards per variant in turns.
   The figure is the median over a variant's steps after its first (the first compiles); "compile
   (s)": the compiled blocks' first calls (`CompileRecord.compile_s`: the compile and that
   call's own run). Inductor's cache is a fresh folder, so every compile is cold, and the speed
   section runs before the quality one. "out rel diff": the compiled run's final output
   against the eager one of the same precision (relative L2). fp8 on a CPU has no float8
   GEMM: `torch._scaled_mm` emulates it, so these fp8 timings say nothing of a GPU's.

Writes both markdown tables to stdout (and --table), the rows to --json.
"""

from __future__ import annotations

import os
import tempfile

# A fresh inductor cache: every compile below is cold, none reuses an earlier run's kernels.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ditango-precision-inductor-"))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ditango import fmt, mean  # noqa: E402
from benchmarks.harness import bench  # noqa: E402
from runtime.compile import CompileRecord, compile_blocks  # noqa: E402
from runtime.denoiser import Denoiser  # noqa: E402
from runtime.models.loading import load_components, resolve_placement  # noqa: E402
from runtime.models.resolve import resolve_model  # noqa: E402
from runtime.models.wan.models import WAN21_1_3B  # noqa: E402
from runtime.quality import latent_rel_err, psnr, ssim  # noqa: E402
from runtime.quantize import quantize_transformers  # noqa: E402

MODEL = "tiny-wan"
WIDE = "wan2.1-1.3b"  # the widths of section 2 (b)
WIDE_BLOCKS = 2
WIDE_TEXT_LEN = 512  # Wan2.1's max_text_len
VARIANTS = (("fp32", False), ("fp32", True), ("fp8", False), ("fp8", True))  # (precision, compiled)


def load_denoiser(fp8: bool) -> Denoiser:
    """A fresh `tiny-wan` on the CPU in float32; `fp8`: its blocks' Linears quantized."""
    resolved = resolve_model(MODEL)
    placement = resolve_placement("cpu")
    denoiser = Denoiser(load_components(resolved, placement), placement, resolved.spec.defaults.max_text_len)
    if fp8:
        denoiser.quantized = quantize_transformers(denoiser.transformers)
    return denoiser


def compiled(transformers) -> CompileRecord:
    """Compile the blocks of `transformers` (lazily, at their first call), dynamo's caches
    emptied first so no earlier model's graphs are reused or recompiled as dynamic."""
    torch._dynamo.reset()
    return compile_blocks(transformers, CompileRecord())


def after_first(step_s: list[float]) -> float:
    """Median seconds over the steps after the first (the first compiles)."""
    return statistics.median(step_s[1:] if len(step_s) > 1 else step_s)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return latent_rel_err(x, ref)


# -- section 1: quality -------------------------------------------------------------------------
def quality(prompts: int, steps: int) -> list[dict]:
    """Per prompt: fp8 vs fp32 eager (frames and latents), compiled fp32 vs eager (latents)."""
    b = bench(prompts, prefix="ditango-precision-")
    eager, d = b.decoder, resolve_model(MODEL).spec.defaults
    fp8 = load_denoiser(fp8=True)
    inputs = {}
    rows = []
    for item_id, spec in b.specs.items():
        started = time.perf_counter()
        text = eager.encode_text(spec.caption, d.negative_prompt, d.guidance)
        latents = eager.initial_latents(0, d.height, d.width, d.frames)
        inputs[item_id] = (text, latents.clone())
        ref = eager.denoise(latents, text, steps, d.guidance)
        low = fp8.denoise(latents, fp8.encode_text(spec.caption, d.negative_prompt, d.guidance), steps, d.guidance)
        ref_frames, frames = eager.decode(ref.latents_BCFHW), eager.decode(low.latents_BCFHW)
        rows.append(
            {
                "id": item_id,
                "caption": spec.caption,
                "psnr": psnr(frames, ref_frames),
                "ssim": ssim(frames, ref_frames),
                "latent_rel_err": latent_rel_err(low.latents_BCFHW, ref.latents_BCFHW),
                "eager_latents": ref.latents_BCFHW,
                "eager_step_s": after_first(ref.step_s),
                "fp8_step_s": after_first(low.step_s),
            }
        )
        print(
            f"quality {item_id}: fp8 {rows[-1]['psnr']:.2f} dB ({time.perf_counter() - started:.0f} s)", file=sys.stderr
        )
    del fp8
    record = compiled(eager.transformers)
    for row in rows:
        started = time.perf_counter()
        text, latents = inputs[row["id"]]
        out = eager.denoise(latents, text, steps, d.guidance).latents_BCFHW
        ref = row.pop("eager_latents")
        row["compiled_max_abs"] = float((out - ref).abs().max())
        row["compiled_rel_l2"] = rel_l2(out, ref)
        row["compile_fallback"] = record.fallback
        print(
            f"compiled {row['id']}: rel L2 {row['compiled_rel_l2']:.2e} ({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
        )
    return rows


def quality_table(rows: list[dict], steps: int) -> str:
    finite = [r["psnr"] for r in rows if math.isfinite(r["psnr"])]
    fallback = next((r["compile_fallback"] for r in rows if r["compile_fallback"]), None)
    header = (
        f"`{MODEL}`, {steps} steps, {len(rows)} prompts (eval_prompts, seed 0), one process, CPU float32. fp8: "
        "`--quantize fp8` (blocks' Linears in float8 e4m3) vs the float32 eager run, decoded frames and final "
        "latents; compiled: the blocks under torch.compile (inductor) vs eager, final latents, every prompt."
        + (f" The compile fell back to eager: {fallback}." if fallback else "")
    )
    lines = [
        header,
        "",
        "| prompt | caption | fp8 PSNR (dB) | fp8 SSIM | fp8 latent rel err | compiled max abs diff "
        "| compiled rel L2 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            r["id"],
            r["caption"],
            f"{r['psnr']:.2f}",
            f"{r['ssim']:.4f}",
            f"{r['latent_rel_err']:.4f}",
            f"{r['compiled_max_abs']:.2e}",
            f"{r['compiled_rel_l2']:.2e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    worst = min(rows, key=lambda r: r["psnr"])
    lines.append(
        f"| mean | | {fmt(mean(finite), '.2f')} | {mean([r['ssim'] for r in rows]):.4f} "
        f"| {mean([r['latent_rel_err'] for r in rows]):.4f} | {mean([r['compiled_max_abs'] for r in rows]):.2e} "
        f"| {mean([r['compiled_rel_l2'] for r in rows]):.2e} |"
    )
    lines.append(
        f"| worst | (PSNR: {worst['id']}) | {worst['psnr']:.2f} | {min(r['ssim'] for r in rows):.4f} "
        f"| {max(r['latent_rel_err'] for r in rows):.4f} | {max(r['compiled_max_abs'] for r in rows):.2e} "
        f"| {max(r['compiled_rel_l2'] for r in rows):.2e} |"
    )
    return "\n".join(lines)


# -- section 2: speed ---------------------------------------------------------------------------
def tiny_speed(rounds: int, steps: int) -> list[dict]:
    """`tiny-wan` at its default size, the first prompt: s per denoising step of each variant,
    the variants taking turns (`rounds` runs of `steps` steps each)."""
    d = resolve_model(MODEL).spec.defaults
    caption = bench(1, prefix="ditango-precision-").specs["p00"].caption
    variants = {}
    for precision, compile_ in VARIANTS:
        denoiser = load_denoiser(precision == "fp8")
        text = denoiser.encode_text(caption, d.negative_prompt, d.guidance)
        latents = denoiser.initial_latents(0, d.height, d.width, d.frames)
        variants[precision, compile_] = (denoiser, text, latents, None, [])
    outputs = {}
    for _ in range(rounds):
        for key, (denoiser, text, latents, record, step_s) in variants.items():
            if key[1] and record is None:  # compiled at its first call: dynamo reset just before
                record = compiled(denoiser.transformers)
                variants[key] = (denoiser, text, latents, record, step_s)
            result = denoiser.denoise(latents, text, steps, d.guidance)
            step_s += result.step_s
            outputs[key] = result.latents_BCFHW
    rows = [speed_row("tiny-wan", *key, v[4], v[3], outputs) for key, v in variants.items()]
    for r in rows:
        print(f"speed tiny-wan {r['precision']} compiled={r['compiled']}: {r['step_ms']:.0f} ms/step", file=sys.stderr)
    return rows


def wide_model() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**{**WAN21_1_3B, "num_layers": WIDE_BLOCKS}).eval()


@torch.no_grad()
def wide_speed(frames: int, forwards: int) -> tuple[list[dict], int]:
    """Wan2.1-1.3B's widths, 2 blocks: s per transformer forward of each variant, the variants
    taking turns (one forward each, `forwards` rounds); and the tokens."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, WAN21_1_3B["in_channels"], frames, 30, 52, generator=gen)
    t = torch.tensor([500.0])
    text = torch.randn(1, WIDE_TEXT_LEN, WAN21_1_3B["text_dim"], generator=gen)
    tokens = frames * (30 // 2) * (52 // 2)
    models, records, step_s, outputs = {}, {}, {key: [] for key in VARIANTS}, {}
    for precision, compile_ in VARIANTS:
        model = wide_model()
        if precision == "fp8":
            quantize_transformers([model])
        models[precision, compile_] = model
    for _ in range(forwards):
        for key, model in models.items():
            if key[1] and key not in records:  # compiled at its first call: dynamo reset just before
                records[key] = compiled([model])
            started = time.perf_counter()
            outputs[key] = model(x, t, text, return_dict=False)[0]
            step_s[key].append(time.perf_counter() - started)
    config = f"{WIDE} widths, {WIDE_BLOCKS} blocks"
    rows = [speed_row(config, *key, step_s[key], records.get(key), outputs) for key in VARIANTS]
    for r in rows:
        print(f"speed wide {r['precision']} compiled={r['compiled']}: {r['step_ms']:.0f} ms/forward", file=sys.stderr)
    return rows, tokens


def speed_row(config: str, precision: str, compile_: bool, step_s: list[float], record, outputs: dict) -> dict:
    eager = outputs.get((precision, False))
    return {
        "config": config,
        "precision": precision,
        "compiled": compile_,
        "step_ms": 1e3 * after_first(step_s),
        "first_step_s": step_s[0],
        "steps_timed": len(step_s),
        "compile_s": None if record is None else record.compile_s,
        "compile_fallback": None if record is None else record.fallback,
        "out_rel_diff_vs_eager": rel_l2(outputs[precision, compile_], eager)
        if compile_ and eager is not None
        else None,
    }


def speed_table(
    rows: list[dict], rounds: int, tiny_steps: int, wide_frames: int, wide_tokens: int, wide_forwards: int
) -> str:
    header = (
        f"CPU, {torch.get_num_threads()} threads, float32 compute, no_grad. ms per step: median over the steps "
        f"after the first (the first compiles). `tiny-wan`: 64x64x17 (320 tokens, 4 blocks), {rounds} runs x "
        f"{tiny_steps} steps of one prompt, a step = both CFG branches + the scheduler. {WIDE} widths (1536 wide, 12 heads x 128, "
        f"FFN 8960, text_dim 4096), {WIDE_BLOCKS} blocks, random weights: latents 1x16x{wide_frames}x30x52 "
        f"({wide_tokens} tokens) + {WIDE_TEXT_LEN} text tokens, a step = one transformer forward, {wide_forwards} "
        "forwards. The four variants of a config take turns. Speed-up: eager ms / compiled ms at the same precision; fp8 vs fp32: eager fp8 ms / eager "
        "fp32 ms (the CPU emulates float8 GEMMs). compile (s): the compiled blocks' first calls, cold cache."
    )
    lines = [
        header,
        "",
        "| config | precision | eager (ms/step) | compiled (ms/step) | speed-up | compile (s) "
        "| compiled vs eager out rel L2 | fp8 vs fp32 eager time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["config"], r["precision"], r["compiled"]): r for r in rows}
    for config in dict.fromkeys(r["config"] for r in rows):
        for precision in ("fp32", "fp8"):
            e, c = by[config, precision, False], by[config, precision, True]
            fp32 = by[config, "fp32", False]["step_ms"]
            compiled_ms = f"{c['step_ms']:.0f}" + (" (fell back to eager)" if c["compile_fallback"] else "")
            cells = [
                config,
                precision,
                f"{e['step_ms']:.0f}",
                compiled_ms,
                f"{e['step_ms'] / c['step_ms']:.2f}x",
                fmt(c["compile_s"], ".1f"),
                fmt(c["out_rel_diff_vs_eager"], ".1e"),
                "ref" if precision == "fp32" else f"{e['step_ms'] / fp32:.2f}x",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="denoising steps of the quality runs")
    ap.add_argument("--prompts", type=int, default=8, help="the first N of eval_prompts")
    ap.add_argument("--rounds", type=int, default=3, help="tiny-wan speed runs per variant, in turns")
    ap.add_argument("--timed-steps", type=int, default=4, help="steps of each tiny-wan speed run")
    ap.add_argument("--wide-frames", type=int, default=5, help="latent frames of the wide config's input")
    ap.add_argument("--wide-forwards", type=int, default=5, help="forwards of each wide-config speed run")
    ap.add_argument("--table", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for name in ("steps", "prompts", "rounds", "timed_steps", "wide_frames", "wide_forwards"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rounds * args.timed_steps < 2 or args.wide_forwards < 2:
        ap.error("the speed runs need 2 steps at least (the first compiles and is not timed)")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    started = time.perf_counter()

    with torch.no_grad():
        speed = tiny_speed(args.rounds, args.timed_steps)
        wide, wide_tokens = wide_speed(args.wide_frames, args.wide_forwards)
        rows = quality(args.prompts, args.steps)
    elapsed = time.perf_counter() - started
    text = "\n\n".join(
        [
            "## fp8 quality and compiled vs eager latents\n\n" + quality_table(rows, args.steps),
            "## CPU speed, compiled vs eager\n\n"
            + speed_table(
                speed + wide, args.rounds, args.timed_steps, args.wide_frames, wide_tokens, args.wide_forwards
            ),
            f"Run time: {elapsed / 60:.1f} min (`benchmarks/precision.py`, torch {torch.__version__}).",
        ]
    )
    print(text)
    if args.table:
        args.table.write_text(text + "\n")
    if args.json:
        finite = [r["psnr"] for r in rows if math.isfinite(r["psnr"])]
        doc = {
            "schema": 1,
            "model": MODEL,
            "steps": args.steps,
            "prompts": args.prompts,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "run_s": elapsed,
            "quality": [{**r, "psnr": r["psnr"] if math.isfinite(r["psnr"]) else None} for r in rows],
            "fp8_psnr_min": min(finite) if finite else None,
            "fp8_psnr_mean": mean(finite),
            "speed": speed + wide,
            "wide": {"config": WIDE, "blocks": WIDE_BLOCKS, "frames": args.wide_frames, "tokens": wide_tokens},
        }
        args.json.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
