"""What the denoising loop asks of a loaded Wan checkpoint: text and image encoding, initial
latents, the scheduler, the expert of each step, the transformer's inputs, and the VAE's.

Diffusers pipeline objects are built over the same components only to reuse their text
cleaning and encoding, latent and image-condition preparation and video post-processing, so
those stay byte-identical to diffusers; their `__call__` is never used.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width, L text
tokens, E text embedding width.
"""

from __future__ import annotations

import torch
from diffusers import WanPipeline

from runtime.loop_types import ImageCondition, TextEmbeds, seeded_latents
from runtime.models import schedulers
from runtime.models.wan.shapes import WanVariant, expert_schedule


class WanModel:
    """Wan2.1 and Wan2.2 (`variant`: two experts switched at `boundary_ratio`, per-token
    timesteps, image-to-video) as diffusers' `WanPipeline` and `WanImageToVideoPipeline` run them."""

    def __init__(self, components: dict, device: torch.device, max_text_len: int, variant: WanVariant | None = None):
        self.device, self.max_text_len = device, max_text_len
        self.variant = variant = variant or WanVariant()
        self.transformers = [components["transformer"]]
        if variant.experts == 2:
            if components.get("transformer_2") is None:
                raise ValueError("a two-expert variant (boundary_ratio) needs components['transformer_2']")
            self.transformers.append(components["transformer_2"])
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        common = {k: components[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler")}
        experts = {"transformer": self.transformers[0], "transformer_2": components.get("transformer_2")}
        config = {"boundary_ratio": variant.boundary_ratio, "expand_timesteps": variant.expand_timesteps}
        self.pipe = WanPipeline(**common, **experts, **config)
        self.pipe.set_progress_bar_config(disable=True)
        self.image_pipe = None
        if variant.image_pipeline():
            from diffusers import WanImageToVideoPipeline

            image = {k: components.get(k) for k in ("image_encoder", "image_processor")}
            self.image_pipe = WanImageToVideoPipeline(**common, **experts, **image, **config)
            self.image_pipe.set_progress_bar_config(disable=True)

    def text_encoders(self) -> list:
        return [self.pipe.text_encoder]

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float):
        """Both branches as the pipeline encodes them (the negative one only when `guidance` > 1)."""
        cond, uncond = (self.image_pipe or self.pipe).encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=guidance > 1.0,
            max_sequence_length=self.max_text_len,
            device=self.device,
        )
        dtype = self.transformers[0].dtype
        return TextEmbeds(cond.to(dtype), None if uncond is None else uncond.to(dtype))

    def latent_channels(self) -> int:
        """Channels of the noise: the transformer's input for text-to-video (as WanPipeline),
        the VAE's latent channels for image-to-video (as WanImageToVideoPipeline)."""
        if self.variant.image == "required":
            return self.vae.config.z_dim
        return self.transformers[0].config.in_channels

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] float32 noise, identical to diffusers' pipelines with a CPU generator seeded `seed`."""
        return seeded_latents(self.pipe, self.latent_channels(), seed, height, width, frames, self.device)

    @torch.no_grad()
    def encode_image(self, image, latents_BCFHW: torch.Tensor, height: int, width: int, frames: int) -> ImageCondition:
        """The image condition of an item, as WanImageToVideoPipeline prepares it: `image` (a
        PIL image) resized to height x width, VAE-encoded (argmax), and for Wan2.1 I2V its CLIP
        embeddings. `latents_BCFHW` is the item's noise (`initial_latents`)."""
        pipe = self.image_pipe
        if pipe is None:
            raise ValueError("this model takes no image (text-to-video only)")
        dtype = self.transformers[0].dtype
        image_BLE = None
        if self.transformers[0].config.image_dim is not None:
            image_BLE = pipe.encode_image(image, self.device).to(dtype)
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        out = pipe.prepare_latents(
            pixels, 1, latents_BCFHW.shape[1], height, width, frames, torch.float32, self.device, None, latents_BCFHW
        )
        if self.variant.expand_timesteps:
            return ImageCondition(out[1], first_frame_mask=out[2], image_BLE=image_BLE)
        return ImageCondition(out[1], image_BLE=image_BLE)

    def new_scheduler(self, steps: int, sampler=None, latents_BCFHW=None):
        """A fresh scheduler (multistep solvers keep per-run state) with its timesteps set."""
        scheduler = schedulers.fresh(self.scheduler, sampler)
        scheduler.set_timesteps(steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def experts(self, timesteps: list[float], num_train_timesteps: int) -> list[int]:
        return expert_schedule(self.variant, timesteps, num_train_timesteps)

    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text_BLE, condition):
        """One transformer evaluation (one CFG branch), with the inputs diffusers' pipelines form."""
        mask = None
        if condition is not None and condition.first_frame_mask is not None:  # TI2V image-to-video
            mask = condition.first_frame_mask
            x = (1 - mask) * condition.latents_BCFHW + mask * latents_BCFHW
        elif condition is not None:  # I2V: the condition joins the noisy latents on the channels
            x = torch.cat([latents_BCFHW, condition.latents_BCFHW], dim=1)
        else:
            x = latents_BCFHW
        batch = latents_BCFHW.shape[0]
        if not self.variant.expand_timesteps:
            timestep = t.expand(batch)
        else:  # per-token timesteps: t everywhere but on the conditioning first frame (0 there)
            if mask is None:
                mask = torch.ones(latents_BCFHW.shape, dtype=torch.float32, device=latents_BCFHW.device)
            _, ph, pw = transformer.config.patch_size
            timestep = (mask[0][0][:, ::ph, ::pw] * t).flatten().unsqueeze(0).expand(batch, -1)
        return transformer(
            hidden_states=x.to(transformer.dtype),
            timestep=timestep,
            encoder_hidden_states=text_BLE,
            encoder_hidden_states_image=None if condition is None else condition.image_BLE,
            return_dict=False,
        )[0]

    def final_latents(self, latents_BCFHW: torch.Tensor, condition) -> torch.Tensor:
        """TI2V returns the image's first frame in place of the denoised one, as diffusers does."""
        if condition is None or condition.first_frame_mask is None:
            return latents_BCFHW
        mask = condition.first_frame_mask
        return (1 - mask) * condition.latents_BCFHW + mask * latents_BCFHW

    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them (WanPipeline's de-normalisation)."""
        vae = self.vae
        z = vae.config.z_dim
        latents = latents_BCFHW.to(self.device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean

    def postprocess(self, video_BCFHW: torch.Tensor):
        """Decoded video -> float frames [F, H, W, 3] in [0, 1] (the pipeline's post-processing)."""
        return self.pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")[0]
