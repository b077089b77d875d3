"""One rank of diffusers' own context parallelism on the built-in model, started by torchrun
(benchmarks/peers.py runs it): WanPipeline with `enable_parallelism(ContextParallelConfig(...))`,
the time at the end of each step (`callback_on_step_end`), and rank 0's final latents.

    torchrun --standalone --nproc-per-node 2 benchmarks/peer_worker.py --ring 2 --out DIR [work options]

On CPU the two patches of tests/diffusers_cp.py make diffusers' CP run (its accelerator count,
and the lse its ring asks of the native backend); nothing of DiTango runs apart from the loader
of the built-in model's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from runtime.models.loading import load_components, resolve_placement  # noqa: E402
from runtime.models.resolve import resolve_model  # noqa: E402
from tests.diffusers_cp import patch_diffusers_for_cpu  # noqa: E402


def wan_pipeline(model: str, parallel=None):
    """(WanPipeline on `model`'s components on CPU, its text length); with `parallel` (a
    diffusers ContextParallelConfig), diffusers' context parallelism installed on it."""
    import diffusers.utils.logging
    from diffusers import WanPipeline

    diffusers.utils.logging.disable_progress_bar()
    resolved = resolve_model(model)
    components = load_components(resolved, resolve_placement("cpu"))
    if parallel is not None:
        components["transformer"].enable_parallelism(config=parallel)
    pipe = WanPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe, resolved.spec.defaults.max_text_len


def generate_latents(pipe, text_len: int, args, on_step=None) -> torch.Tensor:
    """The final latents of `pipe` on the work `args` names (prompt, seed, steps, guidance, size);
    `on_step(pipe, step, timestep, kwargs)` at the end of each step."""
    return pipe(
        prompt=args.prompt,
        negative_prompt="",
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        output_type="latent",
        generator=torch.Generator("cpu").manual_seed(args.seed),
        callback_on_step_end=on_step,
        max_sequence_length=text_len,
    ).frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ring", type=int, default=1)
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="tiny-wan")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--guidance", type=float, required=True)
    ap.add_argument("--height", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--frames", type=int, required=True)
    args = ap.parse_args()
    from diffusers import ContextParallelConfig

    rank = int(os.environ["RANK"])
    patch_diffusers_for_cpu(args.ring)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    pipe, text_len = wan_pipeline(args.model, ContextParallelConfig(ring_degree=args.ring, ulysses_degree=args.ulysses))
    ends: list[float] = []

    def step_end(pipe, step, timestep, kwargs):
        ends.append(time.perf_counter())
        return kwargs

    start = time.perf_counter()
    latents = generate_latents(pipe, text_len, args, step_end)
    if rank == 0:  # the first step's time includes the text encoding: the table uses steps 2..
        args.out.mkdir(parents=True, exist_ok=True)
        save_file({"latents": latents.contiguous()}, str(args.out / "latents.safetensors"))
        steps = [b - a for a, b in zip([start, *ends], ends, strict=False)]
        (args.out / "steps.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
