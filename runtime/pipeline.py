"""The denoising loop: ours, over diffusers' Wan components.

Later strategies need to control every CFG branch and every step, so the loop is
written out here instead of calling `WanPipeline.__call__`. It reproduces that call
exactly (same text encoding, same initial latents from the seed, same guidance combine
and scheduler stepping); tests/test_parity.py holds it to <= 1e-5 in float32.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width,
L text tokens, E text embedding width.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from diffusers import WanPipeline

from runtime.guidance import CfgParallel, SequentialCfg
from runtime.models.families import adapter_for
from runtime.models.loading import Placement
from runtime.models.wan import WanVariant
from runtime.step_cache import StepCache
from runtime.vae import DecodeOptions, decode_video


class DenoiseListener(Protocol):
    def begin_run(self, latents_BCFHW: torch.Tensor, steps: int, branches: int, switches: tuple[int, ...]) -> None: ...
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


def host_timesteps(scheduler) -> list[float]:
    """The scheduler's timesteps as host numbers (one copy from the device)."""
    return scheduler.timesteps.tolist()


def switch_steps(experts: list[int]) -> tuple[int, ...]:
    return tuple(i for i in range(1, len(experts)) if experts[i] != experts[i - 1])


def synchronize(device: torch.device) -> None:
    """Make wall-clock timings honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ImageCondition:
    """Image-to-video inputs of one item, fixed over its run (diffusers' WanImageToVideoPipeline).

    `latents_BCFHW`: the VAE-encoded conditioning video: [mask (4 ch) | image latents] joined to
    the noisy latents on the channels, or (per-token timesteps, TI2V) the first frame's latents
    that replace the noisy latents where `first_frame_mask` is 0. `image_BLE`: CLIP image
    embeddings for the cross-attention (Wan2.1 I2V), else None."""

    latents_BCFHW: torch.Tensor
    first_frame_mask: torch.Tensor | None = None
    image_BLE: torch.Tensor | None = None


class WanDenoiser:
    """Text (and image) encoding, initial latents, the denoising loop and VAE decoding.

    Diffusers pipeline objects are built over the same components only to reuse their text
    cleaning/encoding, latent and image-condition preparation and video post-processing, so
    those stay byte-identical to diffusers; their `__call__` is never used. `variant` says what
    the checkpoint asks beyond Wan2.1 text-to-video (runtime/models/wan.py): two experts
    switched at `boundary_ratio`, per-token timesteps, image-to-video.
    """

    def __init__(self, components: dict, placement: Placement, max_text_len: int, variant: WanVariant | None = None):
        self.placement = placement
        self.max_text_len = max_text_len
        self.variant = variant = variant or WanVariant()
        self.transformers = [components["transformer"]]
        if variant.experts == 2:
            if components.get("transformer_2") is None:
                raise ValueError("a two-expert variant (boundary_ratio) needs components['transformer_2']")
            self.transformers.append(components["transformer_2"])
        self.expert = 0  # the expert of the step being run
        self.vae = components["vae"]
        self._scheduler_template = components["scheduler"]
        common = {k: components[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler")}
        experts = {"transformer": self.transformers[0], "transformer_2": components.get("transformer_2")}
        config = {"boundary_ratio": variant.boundary_ratio, "expand_timesteps": variant.expand_timesteps}
        self.pipe = WanPipeline(**common, **experts, **config)
        self.image_pipe = None
        if variant.image_pipeline():
            from diffusers import WanImageToVideoPipeline

            image = {k: components.get(k) for k in ("image_encoder", "image_processor")}
            self.image_pipe = WanImageToVideoPipeline(**common, **experts, **image, **config)
            self.image_pipe.set_progress_bar_config(disable=True)
        self.pipe.set_progress_bar_config(disable=True)
        # Told where the loop is (run, step, CFG branch): strategies that plan per step use it.
        self.listener: DenoiseListener | None = None
        # How the CFG branches run (runtime/guidance.py); default: both here, cond then uncond.
        self.guidance: SequentialCfg | CfgParallel = SequentialCfg()
        self._condition: ImageCondition | None = None  # the image condition of the run in progress
        self.step_cache: StepCache | None = None  # --step-cache (runtime/step_cache.py)
        self.branch_name = "cond"

    @property
    def transformer(self):
        """The expert of the current step (the only one outside a two-expert run)."""
        return self.transformers[self.expert]

    def begin_branch(self, branch: int, name: str = "cond") -> None:
        """The next evaluation is CFG branch `branch` of this rank ("cond" or "uncond")."""
        self.branch_name = name
        if self.listener is not None:
            self.listener.begin_branch(branch)

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str, guidance: float) -> TextEmbeds:
        cond, uncond = (self.image_pipe or self.pipe).encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=guidance > 1.0,
            max_sequence_length=self.max_text_len,
            device=self.device,
        )
        dtype = self.transformer.dtype
        return TextEmbeds(cond.to(dtype), None if uncond is None else uncond.to(dtype))

    def latent_channels(self) -> int:
        """Channels of the noise: the transformer's input for text-to-video (as WanPipeline),
        the VAE's latent channels for image-to-video (as WanImageToVideoPipeline)."""
        return self.vae.config.z_dim if self.variant.image == "required" else self.transformer.config.in_channels

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] float32 noise, identical to diffusers' pipelines with a CPU generator seeded `seed`."""
        return self.pipe.prepare_latents(
            batch_size=1,
            num_channels_latents=self.latent_channels(),
            height=height,
            width=width,
            num_frames=frames,
            dtype=torch.float32,
            device=self.device,
            generator=torch.Generator("cpu").manual_seed(seed),
        )

    @torch.no_grad()
    def encode_image(self, image, latents_BCFHW: torch.Tensor, height: int, width: int, frames: int) -> ImageCondition:
        """The image condition of an item, as WanImageToVideoPipeline prepares it: `image` (a
        PIL image) resized to height x width, VAE-encoded (argmax), and for Wan2.1 I2V its CLIP
        embeddings. `latents_BCFHW` is the item's noise (`initial_latents`)."""
        pipe = self.image_pipe
        if pipe is None:
            raise ValueError("this model takes no image (text-to-video only)")
        image_BLE = None
        if self.transformers[0].config.image_dim is not None:
            image_BLE = pipe.encode_image(image, self.device).to(self.transformer.dtype)
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        out = pipe.prepare_latents(
            pixels, 1, latents_BCFHW.shape[1], height, width, frames, torch.float32, self.device, None, latents_BCFHW
        )
        if self.variant.expand_timesteps:
            return ImageCondition(out[1], first_frame_mask=out[2], image_BLE=image_BLE)
        return ImageCondition(out[1], image_BLE=image_BLE)

    def new_scheduler(self, steps: int):
        """A fresh scheduler (multistep solvers keep per-run state) with its timesteps set."""
        scheduler = type(self._scheduler_template).from_config(self._scheduler_template.config)
        scheduler.set_timesteps(steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def experts(self, scheduler) -> list[int]:
        """Per step, 0 for `transformer`, 1 for `transformer_2` (below boundary_ratio x the
        training timesteps), as diffusers' Wan pipelines choose; read from the host copy of the
        timesteps once per run (a comparison on the device would wait for it every step)."""
        ratio = self.variant.boundary_ratio
        if ratio is None:
            return [0] * len(scheduler.timesteps)
        boundary = ratio * scheduler.config.num_train_timesteps
        return [0 if t >= boundary else 1 for t in host_timesteps(scheduler)]

    def model_input(self, latents_BCFHW: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, timestep) for the transformer, as diffusers' pipelines form them."""
        cond = self._condition
        mask = None
        if cond is not None and cond.first_frame_mask is not None:  # TI2V image-to-video
            mask = cond.first_frame_mask
            x = (1 - mask) * cond.latents_BCFHW + mask * latents_BCFHW
        elif cond is not None:  # I2V: the condition joins the noisy latents on the channels
            x = torch.cat([latents_BCFHW, cond.latents_BCFHW], dim=1)
        else:
            x = latents_BCFHW
        batch = latents_BCFHW.shape[0]
        if not self.variant.expand_timesteps:
            return x, t.expand(batch)
        # Per-token timesteps: t everywhere but on the conditioning first frame (0 there).
        if mask is None:
            mask = torch.ones(latents_BCFHW.shape, dtype=torch.float32, device=latents_BCFHW.device)
        _, ph, pw = self.transformer.config.patch_size
        per_token = (mask[0][0][:, ::ph, ::pw] * t).flatten()
        return x, per_token.unsqueeze(0).expand(batch, -1)

    def predict(self, latents_BCFHW: torch.Tensor, t: torch.Tensor, text_BLE: torch.Tensor) -> torch.Tensor:
        """One transformer evaluation (one CFG branch) by the current expert; the seam parallel
        strategies hook into."""
        x, timestep = self.model_input(latents_BCFHW, t)
        cond = self._condition
        with self.cache_context():
            return self.transformer(
                hidden_states=x.to(self.transformer.dtype),
                timestep=timestep,
                encoder_hidden_states=text_BLE,
                encoder_hidden_states_image=None if cond is None else cond.image_BLE,
                return_dict=False,
            )[0]

    def cache_context(self):
        """The step cache's context of this evaluation (its CFG branch), if one is on."""
        if self.step_cache is None:
            return contextlib.nullcontext()
        return self.step_cache.forward(self.transformer, self.branch_name)

    def switches(self, scheduler) -> tuple[int, ...]:
        """Steps where the expert changes (none for one expert)."""
        return switch_steps(self.experts(scheduler))

    @torch.no_grad()
    def denoise(
        self,
        latents_BCFHW: torch.Tensor,
        text: TextEmbeds,
        steps: int,
        guidance: float,
        on_step: Callable[[int, int], None] | None = None,
        condition: ImageCondition | None = None,
        guidance_2: float | None = None,
        run_steps: frozenset[int] | None = None,
    ) -> DenoiseResult:
        """`guidance_2`: the low-noise expert's CFG scale (default `guidance`, as diffusers);
        `run_steps`: only these steps of the schedule run (a rehearsal's sample), None: all."""
        scheduler = self.new_scheduler(steps)
        result = DenoiseResult(latents_BCFHW)
        latents = latents_BCFHW
        listener, cache = self.listener, self.step_cache
        self._condition = condition
        experts = self.experts(scheduler)
        if listener is not None:
            listener.begin_run(latents, steps, self.guidance.local_branches(text), switch_steps(experts))
        self.guidance.begin_run(steps)
        finite: list[torch.Tensor] = []  # per step, on the device: no host sync inside the loop
        try:
            if cache is not None:
                cache.begin_run(self.transformers, adapter_for(self.transformers[0]), steps)
            for i, t in enumerate(scheduler.timesteps):
                if run_steps is not None and i not in run_steps:
                    continue
                start = time.perf_counter()
                self.expert = experts[i]
                scale = guidance if self.expert == 0 or guidance_2 is None else guidance_2
                if listener is not None:
                    listener.begin_step(i)
                if cache is not None:
                    cache.begin_step(i, t)
                noise = self.guidance.noise(self, i, t, latents, text, scale)
                latents = scheduler.step(noise, t, latents, return_dict=False)[0]
                finite.append(torch.isfinite(latents).all())
                if listener is not None:
                    listener.end_step(i)
                synchronize(self.device)
                result.step_s.append(time.perf_counter() - start)
                if on_step is not None:
                    on_step(i + 1, steps)
        finally:  # a failed item frees its buffers too: a retry's automatic cache cap reads free memory
            self.expert, self._condition = 0, None
            try:
                if listener is not None:
                    listener.end_run()
            finally:
                if cache is not None:
                    cache.end_run()
        if condition is not None and condition.first_frame_mask is not None:
            mask = condition.first_frame_mask  # TI2V: the first frame is the image's, as diffusers returns it
            latents = (1 - mask) * condition.latents_BCFHW + mask * latents
        result.latents_BCFHW = latents
        flags = torch.stack(finite).tolist() if finite else []
        result.first_nonfinite_step = next((i + 1 for i, ok in enumerate(flags) if not ok), None)
        return result

    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them (WanPipeline's de-normalisation)."""
        vae = self.vae
        z = vae.config.z_dim
        latents = latents_BCFHW.to(self.device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean

    def decode(self, latents_BCFHW: torch.Tensor) -> np.ndarray:
        """Latents -> uint8 frames [F, H, W, 3] (first batch entry), as the diffusers pipeline
        decodes them (one process, untiled)."""
        return self.decode_with(latents_BCFHW, DecodeOptions())[0]

    @torch.no_grad()
    def decode_with(
        self, latents_BCFHW: torch.Tensor, options: DecodeOptions, ctx=None
    ) -> tuple[np.ndarray | None, dict]:
        """(uint8 frames [F, H, W, 3] on the writer, None elsewhere; the decode's record):
        tiled and spread over `ctx`'s ranks as `options` say (runtime/vae.py)."""
        decoded = decode_video(self.vae, self.vae_input(latents_BCFHW), options, ctx)
        if decoded.video_BCFHW is None:
            return None, decoded.record
        frames = self.pipe.video_processor.postprocess_video(decoded.video_BCFHW, output_type="np")[0]
        return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8), decoded.record


@dataclass
class HunyuanText:
    """One CFG branch's text inputs of HunyuanVideo, with the embedded guidance it runs with."""

    inputs: dict  # encoder_hidden_states, encoder_attention_mask, pooled_projections
    guidance: torch.Tensor  # [B] embedded guidance x 1000 (the same in both branches)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.inputs["encoder_hidden_states"].shape)


class HunyuanDenoiser(WanDenoiser):
    """HunyuanVideo's loop (`HunyuanVideoPipeline`): the same denoising loop, listeners and CFG
    runners as Wan's, with this family's text encoding (Llama with a prompt template + CLIP
    pooled), embedded guidance and flow-matching sigmas.

    `embedded_guidance` is diffusers' `guidance_scale` (distilled into the model); real
    classifier-free guidance (diffusers' `true_cfg_scale`) is the `guidance` of `encode_text`
    and `denoise`, and runs two branches only when it is > 1."""

    def __init__(self, components: dict, placement: Placement, max_text_len: int, prompt_template: dict | None = None):
        from diffusers import HunyuanVideoPipeline

        self.placement = placement
        self.max_text_len = max_text_len
        self.variant = WanVariant()  # one expert, no per-token timesteps, no image
        self.transformers = [components["transformer"]]
        self.expert = 0
        self.vae = components["vae"]
        self._scheduler_template = components["scheduler"]
        self.pipe = HunyuanVideoPipeline(**{k: components[k] for k in (
            "text_encoder", "tokenizer", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2")})  # fmt: skip
        self.pipe.set_progress_bar_config(disable=True)
        self.image_pipe = None
        self.prompt_template = prompt_template
        self.embedded_guidance = 6.0  # the pipeline's default guidance_scale
        self.listener: DenoiseListener | None = None
        self.guidance: SequentialCfg | CfgParallel = SequentialCfg()
        self._condition = None
        self.step_cache: StepCache | None = None
        self.branch_name = "cond"

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float) -> TextEmbeds:
        """`guidance`: the real CFG scale (diffusers' true_cfg_scale); the negative branch
        exists when it is > 1 and a negative prompt is given, as in the pipeline."""
        from runtime.models.hunyuan import guidance_tensor, prompt_embeds

        dtype = self.transformer.dtype
        g = guidance_tensor(self.embedded_guidance, 1, dtype, self.device)

        def encode(text: str) -> HunyuanText:
            inputs = prompt_embeds(self.pipe, text, self.prompt_template, self.max_text_len, self.device, dtype)
            return HunyuanText(inputs, g)

        negative = encode(negative_prompt) if guidance > 1.0 and negative_prompt is not None else None
        return TextEmbeds(encode(prompt), negative)

    def latent_channels(self) -> int:
        return self.transformer.config.in_channels

    def new_scheduler(self, steps: int):
        scheduler = type(self._scheduler_template).from_config(self._scheduler_template.config)
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]  # the pipeline's default schedule
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def predict(self, latents_BCFHW: torch.Tensor, t: torch.Tensor, text: HunyuanText) -> torch.Tensor:
        with self.cache_context():
            return self.transformer(
                hidden_states=latents_BCFHW.to(self.transformer.dtype),
                timestep=t.expand(latents_BCFHW.shape[0]).to(latents_BCFHW.dtype),
                guidance=text.guidance,
                return_dict=False,
                **text.inputs,
            )[0]

    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them (HunyuanVideoPipeline's scaling)."""
        return latents_BCFHW.to(self.device, dtype=self.vae.dtype) / self.vae.config.scaling_factor
