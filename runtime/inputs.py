"""What an item's denoising starts from, and its exact counterpart (--reference exact,
--target-psnr)."""

from __future__ import annotations

import time

import torch

from runtime.config import Item, RunConfig
from runtime.items import load_image
from runtime.pipeline import WanDenoiser, synchronize
from runtime.report import ItemTiming
from runtime.weights import place


def item_inputs(denoiser: WanDenoiser, item: Item, cfg: RunConfig, timing: ItemTiming | None = None) -> tuple:
    """(text, initial latents, image condition or None) of `item`, the text encoders on the
    device only while they encode."""
    device = denoiser.device
    start = time.perf_counter()
    if item.true_cfg is not None:  # HunyuanVideo: --guidance is the embedded guidance
        denoiser.embedded_guidance = item.guidance
    encoders = [getattr(denoiser.pipe, n, None) for n in ("text_encoder", "text_encoder_2")]
    encoders = [e for e in encoders if e is not None] if "text_encoder" in cfg.offload else []
    place(encoders, device)
    text = denoiser.encode_text(item.prompt, item.negative_prompt, item.cfg_scale)
    place(encoders, torch.device("cpu"))  # encoded once per item; the encoder waits on the CPU
    if "transformer" in cfg.offload:
        place(denoiser.transformers, device)  # back from the previous item's decode
    synchronize(device)
    if timing is not None:
        timing.text_encode_s = time.perf_counter() - start
    latents = denoiser.initial_latents(item.seed, item.height, item.width, item.frames)
    condition = None
    if item.image is not None:
        image = load_image(item.image)
        condition = denoiser.encode_image(image, latents, item.height, item.width, item.frames)
    return text, latents, condition


def exact_reference(denoiser: WanDenoiser, latents, text, item: Item, condition=None) -> torch.Tensor:
    """The same item exact: DiTango's runtime (the ring path instead) and the step cache off for
    one run; a step cache calibrating stays on (it never skips)."""
    listener, cache = denoiser.listener, denoiser.step_cache
    selective = None if listener is None else listener.ctx.selective
    if listener is not None:
        listener.ctx.selective = None  # ShardContext falls back to ring over the cp group
    if cache is not None and not cache.calibrating:
        denoiser.step_cache = None
    try:
        return denoiser.denoise(
            latents, text, item.steps, item.cfg_scale, condition=condition, guidance_2=item.guidance_2
        ).latents_BCFHW
    finally:
        denoiser.step_cache = cache
        if listener is not None:
            listener.ctx.selective = selective
