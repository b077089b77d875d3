"""Overhead of `ditango generate`'s own denoising loop vs diffusers' WanPipeline.

Same model, same process, same inputs; runs are interleaved (ours, theirs, ours, ...)
so machine drift hits both equally. Prints a markdown table.

    .venv/bin/python benchmarks/overhead.py [--runs 7] [--steps 20] [--height 128 --width 128 --frames 17]

"ours" is the generate path itself (`runtime.run.execute` on a one-item RunConfig, as
the CLI calls it, writing MP4 + sidecar + report); its phase times come from the
item's report. "theirs" is `WanPipeline.__call__` on components loaded the same way.
Phases:
- denoise: initial latents + the full denoising loop (theirs: given prompt_embeds,
  output_type="latent"; ours: report `timing.denoise_s`);
- end-to-end: text encode + denoise + decode + writing the MP4 (theirs: output_type="np"
  then diffusers' `export_to_video`; ours: report `timing.total_s`).
Target: median ratio ours/theirs <= 1.03 for the denoise phase.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import diffusers.utils.logging
import torch
import transformers.utils.logging
from diffusers import WanPipeline
from diffusers.utils import export_to_video
from safetensors.torch import load_file

from runtime.config import Item, RunConfig
from runtime.denoiser import Denoiser
from runtime.models.loading import load_components, resolve_placement
from runtime.models.resolve import resolve_model
from runtime.run import execute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-wan")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--guidance", type=float, default=5.0)
    args = ap.parse_args()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    if args.runs < 5:
        ap.error("--runs must be >= 5 (medians of fewer runs are noise)")

    resolved = resolve_model(args.model)
    placement = resolve_placement("auto")
    components = load_components(resolved, placement)
    text_len = resolved.spec.defaults.max_text_len
    pipe = WanPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    prompt, negative, seed = "a red circle moving left on a black background", "", 0
    size = dict(height=args.height, width=args.width, num_frames=args.frames)
    text = Denoiser(components, placement, text_len).encode_text(prompt, negative, args.guidance)
    out = Path(tempfile.mkdtemp(prefix="ditango-overhead-"))
    d = resolved.spec.defaults
    geometry = {"vae_stride": d.vae_stride, "temporal_stride": d.temporal_stride, "patch": d.patch}
    item = Item(
        "bench", prompt, negative, seed, args.height, args.width, args.frames, args.steps, args.guidance, **geometry
    )
    cfg = RunConfig(
        model=args.model,
        model_path=None if resolved.spec.builtin else resolved.path,
        items=(item,),
        out_dir=out,
        device=placement.device.type,
        save_latents=True,
        overwrite=True,
        max_text_len=text_len,
    )

    def ours() -> tuple[float, float]:
        timing = execute(cfg)["items"][0]["timing"]
        return timing["denoise_s"], timing["total_s"]

    def theirs_denoise() -> float:
        start = time.perf_counter()
        pipe(
            prompt_embeds=text.cond_BLE,
            negative_prompt_embeds=text.uncond_BLE,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="latent",
            **size,
        )
        return time.perf_counter() - start

    def theirs_e2e() -> float:
        start = time.perf_counter()
        frames = pipe(
            prompt=prompt,
            negative_prompt=negative,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            max_sequence_length=text_len,
            **size,
        ).frames[0]
        export_to_video(list(frames), str(out / "theirs.mp4"), fps=16)
        return time.perf_counter() - start

    # Same answer first: a benchmark of two different computations means nothing.
    ours()
    reference = pipe(
        prompt=prompt,
        negative_prompt=negative,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="latent",
        max_sequence_length=text_len,
        **size,
    ).frames
    diff = (load_file(out / "bench.latents.safetensors")["latents"] - reference.cpu()).abs().max().item()
    if diff > 1e-5:
        raise SystemExit(f"outputs differ (max |latent diff| {diff:.2e}): not benchmarking different computations")

    ours_d, ours_e, theirs_d, theirs_e = [], [], [], []
    for _ in range(args.runs):
        d, e = ours()
        ours_d.append(d)
        ours_e.append(e)
        theirs_d.append(theirs_denoise())
        theirs_e.append(theirs_e2e())
    rows = [("denoise", ours_d, theirs_d), ("end-to-end", ours_e, theirs_e)]

    print(
        f"model {args.model}, {placement.device} {placement.dtype_name}, {args.width}x{args.height}x{args.frames}, "
        f"{args.steps} steps, guidance {args.guidance}, median of {args.runs} interleaved runs, "
        f"max |latent diff| {diff:.1e}\n"
    )
    print("| phase | ditango generate (s) | diffusers WanPipeline (s) | ratio |")
    print("|---|---:|---:|---:|")
    for phase, a, b in rows:
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {phase} | {ma:.4f} | {mb:.4f} | {ma / mb:.3f} |")


if __name__ == "__main__":
    main()
