"""The values the denoising loop passes between a model family and the strategies.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width,
L text tokens, E text embedding width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TextEmbeds:
    """One item's text, per CFG branch, in the form its family's transformer takes (Wan:
    [B, L, E] tensors; HunyuanVideo: runtime/models/hunyuan/loop.py's HunyuanText)."""

    cond_BLE: torch.Tensor
    uncond_BLE: torch.Tensor | None  # None when guidance is off (guidance <= 1)

    def __repr__(self) -> str:
        un = None if self.uncond_BLE is None else tuple(self.uncond_BLE.shape)
        return f"TextEmbeds(cond={tuple(self.cond_BLE.shape)}, uncond={un})"


@dataclass
class ImageCondition:
    """Image-to-video inputs of one item, fixed over its run (diffusers' WanImageToVideoPipeline,
    HunyuanVideo15ImageToVideoPipeline).

    `latents_BCFHW`: the VAE-encoded conditioning video joined to the noisy latents on the
    channels (Wan: [mask (4 ch) | image latents]; HunyuanVideo-1.5: [image latents | mask (1
    ch)]), or (per-token timesteps, TI2V) the first frame's latents that replace the noisy
    latents where `first_frame_mask` is 0. `image_BLE`: image embeddings (Wan2.1 I2V's CLIP ones
    for the cross-attention, HunyuanVideo-1.5's SigLIP tokens for its joint text), else None."""

    latents_BCFHW: torch.Tensor
    first_frame_mask: torch.Tensor | None = None
    image_BLE: torch.Tensor | None = None


@dataclass
class DenoiseResult:
    latents_BCFHW: torch.Tensor  # float32, exactly what the diffusers pipeline returns (output_type="latent")
    step_s: list[float] = field(default_factory=list)
    # The first step (1-based) after which the latents held a NaN or inf; None: they never did.
    first_nonfinite_step: int | None = None
    # The audio latents denoised with the video (a model with an audio stream: LTX-2), float32.
    audio_BCLM: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"DenoiseResult(latents_BCFHW={tuple(self.latents_BCFHW.shape)}, steps={len(self.step_s)})"


class NonFiniteLatents(RuntimeError):
    """The denoised latents hold NaN/inf values (a NaN weight, an fp16 overflow). The same model,
    item and layout give the same numbers again, so such an item is failed, not retried."""


def seeded_latents(pipe, channels: int, seed: int, height: int, width: int, frames: int, device) -> torch.Tensor:
    """[1, C, F, H, W] float32 noise from a diffusers pipeline's `prepare_latents`, identical
    to the pipeline's own with a CPU generator seeded `seed`."""
    return pipe.prepare_latents(
        batch_size=1,
        num_channels_latents=channels,
        height=height,
        width=width,
        num_frames=frames,
        dtype=torch.float32,
        device=device,
        generator=torch.Generator("cpu").manual_seed(seed),
    )
