"""The denoising loop: ours, over diffusers' Wan components.

Later strategies need to control every CFG branch and every step, so the loop is
written out here instead of calling `WanPipeline.__call__`. It reproduces that call
exactly (same text encoding, same initial latents from the seed, same guidance combine
and scheduler stepping); tests/test_parity.py holds it to <= 1e-5 in float32.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width,
L text tokens, E text embedding width.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from diffusers import WanPipeline

from runtime.guidance import CfgParallel, SequentialCfg
from runtime.models.loading import Placement


class DenoiseListener(Protocol):
    def begin_run(self, latents_BCFHW: torch.Tensor, steps: int, branches: int) -> None: ...
    def begin_step(self, step: int) -> None: ...
    def begin_branch(self, branch: int) -> None: ...
    def end_step(self, step: int) -> None: ...
    def end_run(self) -> None: ...


@dataclass
class TextEmbeds:
    cond_BLE: torch.Tensor
    uncond_BLE: torch.Tensor | None  # None when guidance is off (guidance <= 1)

    def __repr__(self) -> str:
        un = None if self.uncond_BLE is None else tuple(self.uncond_BLE.shape)
        return f"TextEmbeds(cond={tuple(self.cond_BLE.shape)}, uncond={un})"


@dataclass
class DenoiseResult:
    latents_BCFHW: torch.Tensor  # float32, exactly what WanPipeline(output_type="latent") returns
    step_s: list[float] = field(default_factory=list)
    # The first step (1-based) after which the latents held a NaN or inf; None: they never did.
    first_nonfinite_step: int | None = None

    def __repr__(self) -> str:
        return f"DenoiseResult(latents_BCFHW={tuple(self.latents_BCFHW.shape)}, steps={len(self.step_s)})"


class NonFiniteLatents(RuntimeError):
    """The denoised latents hold NaN/inf values (a NaN weight, an fp16 overflow). The same model,
    item and layout give the same numbers again, so such an item is failed, not retried."""


def synchronize(device: torch.device) -> None:
    """Make wall-clock timings honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WanDenoiser:
    """Text encoding, initial latents, the denoising loop and VAE decoding for one model.

    A `WanPipeline` object is built over the same components only to reuse its text
    cleaning/encoding, latent initialisation and video post-processing helpers, so those
    stay byte-identical to diffusers; its `__call__` is never used.
    """

    def __init__(self, components: dict, placement: Placement, max_text_len: int) -> None:
        self.placement = placement
        self.max_text_len = max_text_len
        self.transformer = components["transformer"]
        self.vae = components["vae"]
        self._scheduler_template = components["scheduler"]
        self.pipe = WanPipeline(
            tokenizer=components["tokenizer"],
            text_encoder=components["text_encoder"],
            vae=components["vae"],
            scheduler=components["scheduler"],
            transformer=components["transformer"],
        )
        self.pipe.set_progress_bar_config(disable=True)
        # Told where the loop is (run, step, CFG branch): strategies that plan per step use it.
        self.listener: DenoiseListener | None = None
        # How the CFG branches run (runtime/guidance.py); default: both here, cond then uncond.
        self.guidance: SequentialCfg | CfgParallel = SequentialCfg()

    def begin_branch(self, branch: int) -> None:
        if self.listener is not None:
            self.listener.begin_branch(branch)

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str, guidance: float) -> TextEmbeds:
        cond, uncond = self.pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=guidance > 1.0,
            max_sequence_length=self.max_text_len,
            device=self.device,
        )
        dtype = self.transformer.dtype
        return TextEmbeds(cond.to(dtype), None if uncond is None else uncond.to(dtype))

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] float32 noise, identical to WanPipeline with a CPU generator seeded `seed`."""
        return self.pipe.prepare_latents(
            batch_size=1,
            num_channels_latents=self.transformer.config.in_channels,
            height=height,
            width=width,
            num_frames=frames,
            dtype=torch.float32,
            device=self.device,
            generator=torch.Generator("cpu").manual_seed(seed),
        )

    def new_scheduler(self, steps: int):
        """A fresh scheduler (multistep solvers keep per-run state) with its timesteps set."""
        scheduler = type(self._scheduler_template).from_config(self._scheduler_template.config)
        scheduler.set_timesteps(steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def predict(self, latents_BCFHW: torch.Tensor, t: torch.Tensor, text_BLE: torch.Tensor) -> torch.Tensor:
        """One transformer evaluation (one CFG branch); the seam parallel strategies hook into."""
        return self.transformer(
            hidden_states=latents_BCFHW.to(self.transformer.dtype),
            timestep=t.expand(latents_BCFHW.shape[0]),
            encoder_hidden_states=text_BLE,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def denoise(
        self,
        latents_BCFHW: torch.Tensor,
        text: TextEmbeds,
        steps: int,
        guidance: float,
        on_step: Callable[[int, int], None] | None = None,
    ) -> DenoiseResult:
        scheduler = self.new_scheduler(steps)
        result = DenoiseResult(latents_BCFHW)
        latents = latents_BCFHW
        listener = self.listener
        if listener is not None:
            listener.begin_run(latents, steps, self.guidance.local_branches(text))
        self.guidance.begin_run(steps)
        finite: list[torch.Tensor] = []  # per step, on the device: no host sync inside the loop
        for i, t in enumerate(scheduler.timesteps):
            start = time.perf_counter()
            if listener is not None:
                listener.begin_step(i)
            noise = self.guidance.noise(self, i, t, latents, text, guidance)
            latents = scheduler.step(noise, t, latents, return_dict=False)[0]
            finite.append(torch.isfinite(latents).all())
            if listener is not None:
                listener.end_step(i)
            synchronize(self.device)
            result.step_s.append(time.perf_counter() - start)
            if on_step is not None:
                on_step(i + 1, steps)
        if listener is not None:
            listener.end_run()
        result.latents_BCFHW = latents
        flags = torch.stack(finite).tolist() if finite else []
        result.first_nonfinite_step = next((i + 1 for i, ok in enumerate(flags) if not ok), None)
        return result

    @torch.no_grad()
    def decode(self, latents_BCFHW: torch.Tensor) -> np.ndarray:
        """Latents -> uint8 frames [F, H, W, 3] (first batch entry), as WanPipeline decodes them."""
        vae = self.vae
        z = vae.config.z_dim
        latents = latents_BCFHW.to(self.device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")[0]
        return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)
