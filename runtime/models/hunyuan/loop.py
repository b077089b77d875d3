"""What the denoising loop asks of a loaded HunyuanVideo checkpoint (`HunyuanVideoPipeline`):
Llama text encoding with a prompt template plus CLIP pooled, embedded guidance, the
flow-matching sigmas, the transformer's inputs and the VAE's scaling.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.loop_types import TextEmbeds, seeded_latents
from runtime.models import schedulers
from runtime.models.hunyuan.shapes import expert_schedule

EMBEDDED_GUIDANCE = 6.0  # the pipeline's default guidance_scale


@dataclass
class HunyuanText:
    """One CFG branch's text inputs of HunyuanVideo, with the embedded guidance it runs with."""

    inputs: dict  # encoder_hidden_states, encoder_attention_mask, pooled_projections
    guidance: torch.Tensor  # [B] embedded guidance x 1000 (the same in both branches)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.inputs["encoder_hidden_states"].shape)


def prompt_embeds(pipe, prompt: str, template: dict | None, max_text_len: int, device, dtype) -> dict:
    """The transformer's text inputs for one prompt, as HunyuanVideoPipeline encodes them."""
    kwargs = {} if template is None else {"prompt_template": template}
    embeds, pooled, mask = pipe.encode_prompt(prompt=prompt, device=device, max_sequence_length=max_text_len, **kwargs)
    return {
        "encoder_hidden_states": embeds.to(dtype),
        "encoder_attention_mask": mask.to(dtype),
        "pooled_projections": pooled.to(dtype),
    }


def guidance_tensor(scale: float, batch: int, dtype, device) -> torch.Tensor:
    """The embedded (distilled) guidance input, as the pipeline makes it."""
    return torch.tensor([scale] * batch, dtype=dtype, device=device) * 1000.0


class HunyuanModel:
    """HunyuanVideo as `HunyuanVideoPipeline` runs it. Its `guidance_scale` is the embedded
    guidance (distilled into the model); real classifier-free guidance (diffusers'
    `true_cfg_scale`) is `encode_text`'s `guidance`, and runs two branches only when it is > 1
    and a negative prompt is given."""

    def __init__(self, components: dict, device: torch.device, max_text_len: int, prompt_template: dict | None = None):
        from diffusers import HunyuanVideoPipeline

        self.device, self.max_text_len = device, max_text_len
        self.transformers = [components["transformer"]]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        names = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2")
        self.pipe = HunyuanVideoPipeline(**{k: components[k] for k in names})
        self.pipe.set_progress_bar_config(disable=True)
        self.prompt_template = prompt_template

    def text_encoders(self) -> list:
        return [self.pipe.text_encoder, self.pipe.text_encoder_2]

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float, embedded: float | None = None):
        """`guidance`: the real CFG scale; `embedded`: the distilled guidance (None: the pipeline's default)."""
        dtype = self.transformers[0].dtype
        g = guidance_tensor(EMBEDDED_GUIDANCE if embedded is None else embedded, 1, dtype, self.device)

        def encode(text: str) -> HunyuanText:
            return HunyuanText(
                prompt_embeds(self.pipe, text, self.prompt_template, self.max_text_len, self.device, dtype), g
            )

        negative = encode(negative_prompt) if guidance > 1.0 and negative_prompt is not None else None
        return TextEmbeds(encode(prompt), negative)

    def latent_channels(self) -> int:
        return self.transformers[0].config.in_channels

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] float32 noise, identical to the pipeline's with a CPU generator seeded `seed`."""
        return seeded_latents(self.pipe, self.latent_channels(), seed, height, width, frames, self.device)

    def encode_image(self, image, latents_BCFHW, height: int, width: int, frames: int):
        raise ValueError("this model takes no image (text-to-video only)")

    def new_scheduler(self, steps: int, sampler=None, latents_BCFHW=None):
        scheduler = schedulers.fresh(self.scheduler, sampler)
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]  # the pipeline's default schedule
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def experts(self, timesteps: list[float], num_train_timesteps: int) -> list[int]:
        return expert_schedule(None, timesteps, num_train_timesteps)

    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text: HunyuanText, condition):
        return transformer(
            hidden_states=latents_BCFHW.to(transformer.dtype),
            timestep=t.expand(latents_BCFHW.shape[0]).to(latents_BCFHW.dtype),
            guidance=text.guidance,
            return_dict=False,
            **text.inputs,
        )[0]

    def final_latents(self, latents_BCFHW: torch.Tensor, condition) -> torch.Tensor:
        return latents_BCFHW

    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them (HunyuanVideoPipeline's scaling)."""
        return latents_BCFHW.to(self.device, dtype=self.vae.dtype) / self.vae.config.scaling_factor

    def postprocess(self, video_BCFHW: torch.Tensor):
        return self.pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")[0]
