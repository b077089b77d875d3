"""What the denoising loop asks of a loaded HunyuanVideo-1.5 checkpoint (`HunyuanVideo15Pipeline`):
Qwen2.5-VL text with the pipeline's system prompt plus ByT5 glyph text, classifier-free
guidance as its guider combines the branches, the flow-matching sigmas, the transformer's
inputs (noise, condition latents and their mask, image embeddings) and the VAE's scaling.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.loop_types import TextEmbeds
from runtime.models import schedulers


@dataclass
class Hunyuan15Text:
    """One CFG branch's text inputs: the Qwen prompt and the ByT5 glyph text with their masks."""

    inputs: dict  # encoder_hidden_states(_2), encoder_attention_mask(_2)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.inputs["encoder_hidden_states"].shape)


class Hunyuan15Model:
    """HunyuanVideo-1.5 text-to-video as `HunyuanVideo15Pipeline` runs it. The CFG scale is the
    item's guidance (the folder's guider scale by default): two branches when it is not 1, the
    negative prompt encoded as the pipeline encodes it ("" when none is given)."""

    def __init__(self, components: dict, device: torch.device, max_text_len: int):
        from diffusers import HunyuanVideo15Pipeline

        self.device, self.max_text_len = device, max_text_len
        self.transformers = [components["transformer"]]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        names = (
            "text_encoder",
            "tokenizer",
            "transformer",
            "vae",
            "scheduler",
            "text_encoder_2",
            "tokenizer_2",
            "guider",
        )
        self.pipe = HunyuanVideo15Pipeline(**{k: components[k] for k in names})
        self.pipe.tokenizer_max_length = max_text_len
        self.pipe.set_progress_bar_config(disable=True)

    def text_encoders(self) -> list:
        return [self.pipe.text_encoder, self.pipe.text_encoder_2]

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float, embedded: float | None = None):
        dtype = self.transformers[0].dtype

        def encode(text: str | None) -> Hunyuan15Text:
            embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(prompt=text, device=self.device, dtype=dtype)
            return Hunyuan15Text(
                {
                    "encoder_hidden_states": embeds,
                    "encoder_attention_mask": mask,
                    "encoder_hidden_states_2": embeds_2,
                    "encoder_attention_mask_2": mask_2,
                }
            )

        negative = encode(negative_prompt) if guidance != 1.0 else None
        return TextEmbeds(encode(prompt), negative)

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] noise drawn as the pipeline draws it (in the transformer's dtype, from a
        CPU generator seeded `seed`), in float32."""
        return self.pipe.prepare_latents(
            batch_size=1,
            num_channels_latents=self.pipe.num_channels_latents,
            height=height,
            width=width,
            num_frames=frames,
            dtype=self.transformers[0].dtype,
            device=self.device,
            generator=torch.Generator("cpu").manual_seed(seed),
        ).float()

    def encode_image(self, image, latents_BCFHW, height: int, width: int, frames: int):
        raise ValueError("this model takes no image (text-to-video only)")

    def new_scheduler(self, steps: int, sampler=None):
        scheduler = schedulers.fresh(self.scheduler, sampler)
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]  # the pipeline's default schedule
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def experts(self, timesteps: list[float], num_train_timesteps: int) -> list[int]:
        return [0] * len(timesteps)

    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text: Hunyuan15Text, condition):
        """The prediction for `latents`: the noise with zero condition latents and mask (text-to-
        video), zero image embeddings (the model masks them out)."""
        dtype = transformer.dtype
        latents = latents_BCFHW.to(dtype)
        B, C, F, H, W = latents.shape
        zeros = latents.new_zeros(B, C + 1, F, H, W)
        image = latents.new_zeros(B, self.pipe.vision_num_semantic_tokens, transformer.config.image_embed_dim)
        return transformer(
            hidden_states=torch.cat([latents, zeros], dim=1),
            image_embeds=image,
            timestep=t.expand(B).to(dtype),
            return_dict=False,
            **text.inputs,
        )[0]

    def final_latents(self, latents_BCFHW: torch.Tensor, condition) -> torch.Tensor:
        return latents_BCFHW

    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them (the pipeline's scaling)."""
        return latents_BCFHW.to(self.device, dtype=self.vae.dtype) / self.vae.config.scaling_factor

    def postprocess(self, video_BCFHW: torch.Tensor):
        return self.pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")[0]
