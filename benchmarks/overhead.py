"""Overhead of ditango's own denoising loop vs calling diffusers' WanPipeline directly.

Same model components, same process, same inputs; runs are interleaved (ours, theirs,
ours, ...) so machine drift hits both equally. Prints a markdown table.

    .venv/bin/python benchmarks/overhead.py [--runs 7] [--steps 20] [--height 128 --width 128 --frames 17]

Phases compared:
- denoise: text embeddings precomputed on both sides (WanPipeline given prompt_embeds),
  initial latents + the full denoising loop, output_type="latent";
- end-to-end: text encode + denoise + VAE decode to frames (no file writing).
Target: median ratio ours/diffusers <= 1.03 for the denoise phase.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import WanPipeline

from runtime.models.loading import load_components, resolve_placement
from runtime.models.registry import resolve_model
from runtime.pipeline import WanDenoiser


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-wan")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.runs < 5:
        ap.error("--runs must be >= 5 (medians of fewer runs are noise)")
    if args.threads:
        torch.set_num_threads(args.threads)

    resolved = resolve_model(args.model)
    placement = resolve_placement("auto")
    components = load_components(resolved, placement)
    text_len = resolved.spec.defaults.max_text_len
    ours = WanDenoiser(components, placement, text_len)
    theirs = WanPipeline(**components)
    theirs.set_progress_bar_config(disable=True)
    prompt, negative, seed = "a red circle moving left on a black background", "", 0
    size = dict(height=args.height, width=args.width, num_frames=args.frames)
    text = ours.encode_text(prompt, negative, args.guidance)

    def ours_denoise():
        x = ours.initial_latents(seed, args.height, args.width, args.frames)
        return ours.denoise(x, text, args.steps, args.guidance).latents_BCFHW

    def theirs_denoise():
        return theirs(
            prompt_embeds=text.cond_BLE, negative_prompt_embeds=text.uncond_BLE, num_inference_steps=args.steps,
            guidance_scale=args.guidance, generator=torch.Generator("cpu").manual_seed(seed),
            output_type="latent", **size,
        ).frames  # fmt: skip

    def ours_e2e():
        t = ours.encode_text(prompt, negative, args.guidance)
        x = ours.initial_latents(seed, args.height, args.width, args.frames)
        return ours.decode(ours.denoise(x, t, args.steps, args.guidance).latents_BCFHW)

    def theirs_e2e():
        return theirs(
            prompt=prompt, negative_prompt=negative, num_inference_steps=args.steps, guidance_scale=args.guidance,
            generator=torch.Generator("cpu").manual_seed(seed), output_type="np", max_sequence_length=text_len,
            **size,
        ).frames  # fmt: skip

    # Same answer first: a benchmark of two different computations means nothing.
    diff = (ours_denoise() - theirs_denoise()).abs().max().item()

    rows = []
    for phase, a, b in (("denoise", ours_denoise, theirs_denoise), ("end-to-end", ours_e2e, theirs_e2e)):
        ta, tb = [], []
        for _ in range(args.runs):
            for fn, acc in ((a, ta), (b, tb)):
                start = time.perf_counter()
                fn()
                if placement.device.type == "cuda":
                    torch.cuda.synchronize()
                acc.append(time.perf_counter() - start)
        ma, mb = statistics.median(ta), statistics.median(tb)
        rows.append((phase, ma, mb, ma / mb))

    print(
        f"model {args.model}, {placement.device} {placement.dtype_name}, {args.width}x{args.height}x{args.frames}, "
        f"{args.steps} steps, guidance {args.guidance}, median of {args.runs} interleaved runs, "
        f"max |latent diff| {diff:.1e}\n"
    )
    print("| phase | ditango (s) | diffusers WanPipeline (s) | ratio |")
    print("|---|---:|---:|---:|")
    for phase, ma, mb, r in rows:
        print(f"| {phase} | {ma:.4f} | {mb:.4f} | {r:.3f} |")


if __name__ == "__main__":
    main()
