"""What an item's denoising starts from, and its exact counterpart (--reference exact,
--target-psnr)."""

from __future__ import annotations

import time

import torch

from runtime.config import Item, RunConfig
from runtime.denoiser import Denoiser, synchronize
from runtime.items import load_image
from runtime.report import ItemTiming
from runtime.weights import place


def item_inputs(denoiser: Denoiser, item: Item, cfg: RunConfig, timing: ItemTiming | None = None) -> tuple:
    """(text, initial latents, image condition or None) of `item`, the text encoders on the
    device only while they encode."""
    device = denoiser.device
    start = time.perf_counter()
    encoders = denoiser.text_encoders() if "text_encoder" in cfg.offload else []
    place(encoders, device)
    # With a true CFG scale (a guidance-distilled model), --guidance is the embedded guidance.
    embedded = None if item.true_cfg is None else item.guidance
    text = denoiser.encode_text(item.prompt, item.negative_prompt, item.cfg_scale, embedded)
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
    streams = getattr(denoiser.model, "condition", None)  # a model with a stream of its own (LTX-2's audio)
    if streams is not None:  # it holds the image's condition too
        condition = streams(item.seed, item.height, item.width, item.frames, item.fps, condition)
    return text, latents, condition


def exact_reference(denoiser: Denoiser, latents, text, item: Item, condition=None, trace=None) -> torch.Tensor:
    """The same item exact (`Denoiser.exact`): what --reference exact measures against
    (`trace`: its latents after every step, see `Denoiser.denoise`)."""
    with denoiser.exact():
        return denoiser.denoise(
            latents,
            text,
            item.steps,
            item.cfg_scale,
            condition=condition,
            guidance_2=item.guidance_2,
            sampler=item.sampler,
            trace=trace,
        ).latents_BCFHW
