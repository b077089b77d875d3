"""What the denoising loop asks of a loaded HunyuanVideo-1.5 checkpoint (`HunyuanVideo15Pipeline`,
`HunyuanVideo15ImageToVideoPipeline`): Qwen2.5-VL text with the pipeline's system prompt plus
ByT5 glyph text, classifier-free guidance as its guider combines the branches, the flow-matching
sigmas, the image condition, the transformer's inputs (noise, condition latents and their mask,
image embeddings) and the VAE's scaling.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.loop_types import ImageCondition, TextEmbeds
from runtime.models.hunyuan.loop import HunyuanModel
from runtime.models.hunyuan15.checkpoint import IMAGE_COMPONENTS


@dataclass
class Hunyuan15Text:
    """One CFG branch's text inputs: the Qwen prompt and the ByT5 glyph text with their masks."""

    inputs: dict  # encoder_hidden_states(_2), encoder_attention_mask(_2)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.inputs["encoder_hidden_states"].shape)


def register_blocks() -> None:
    """Make HunyuanVideo-1.5's blocks known to diffusers' first-block and MagCache hooks
    (--step-cache), which find what a block returns in a registry keyed by its class: diffusers
    (0.42) does not register HunyuanVideo15TransformerBlock, and enabling the cache failed with
    "Model class HunyuanVideo15TransformerBlock not registered". It returns (video, text), as
    HunyuanVideo's dual-stream block, which diffusers registers so."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    try:
        TransformerBlockRegistry.get(HunyuanVideo15TransformerBlock)
    except ValueError:
        metadata = TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1)
        TransformerBlockRegistry.register(model_class=HunyuanVideo15TransformerBlock, metadata=metadata)


class Hunyuan15Model(HunyuanModel):
    """HunyuanVideo-1.5 as `HunyuanVideo15Pipeline` runs it, or (`variant.image` "required")
    `HunyuanVideo15ImageToVideoPipeline`. The CFG scale is the item's guidance (the folder's
    guider scale by default): two branches unless it is 1, the negative prompt encoded as the
    pipeline encodes it ("" when none is given). The flow-matching sigmas, the VAE's scaling
    and the postprocessing are HunyuanVideo's."""

    def __init__(self, components: dict, device: torch.device, max_text_len: int, variant=None):
        from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

        self.device, self.max_text_len = device, max_text_len
        register_blocks()
        self.transformers = [components["transformer"]]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        names = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2")
        names += ("guider",)
        self.image = variant is not None and variant.image == "required"
        if self.image:
            names += IMAGE_COMPONENTS
        pipeline = HunyuanVideo15ImageToVideoPipeline if self.image else HunyuanVideo15Pipeline
        self.pipe = pipeline(**{k: components[k] for k in names})
        self.pipe.tokenizer_max_length = max_text_len
        self.pipe.set_progress_bar_config(disable=True)
        # MeanFlow (a step-distilled checkpoint): the image-to-video pipeline also passes the
        # next step's timestep (`timestep_r`, 0 after the last); the text-to-video one never does.
        self.meanflow = self.image and bool(self.transformers[0].config.use_meanflow)
        self._schedule: tuple[torch.Tensor, torch.Tensor] | None = None  # (timesteps, the next of each)

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float):
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

        negative = None if math.isclose(guidance, 1.0) else encode(negative_prompt)  # as the guider decides
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

    @torch.no_grad()
    def encode_image(self, image, latents_BCFHW: torch.Tensor, height: int, width: int, frames: int) -> ImageCondition:
        """The image condition of an item as HunyuanVideo15ImageToVideoPipeline prepares it:
        `image` (a PIL image) resized to cover height x width and center-cropped, its SigLIP
        tokens [1, 729, E] (`image_BLE`), and [1, C + 1, F, H, W] (`latents_BCFHW`): its VAE
        latents (argmax, times the scaling factor) in frame 0, zeros after, then the mask
        channel (1 on frame 0), in the transformer's dtype. `latents_BCFHW` (the item's
        noise) gives the shape."""
        if not self.image:
            raise ValueError("this model takes no image (text-to-video only)")
        pipe, dtype = self.pipe, self.transformers[0].dtype
        image = pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")
        image_BLE = pipe.encode_image(image=image, batch_size=1, device=self.device, dtype=dtype)
        cond, mask = pipe.prepare_cond_latents_and_mask(latents_BCFHW, image, 1, height, width, dtype, self.device)
        return ImageCondition(torch.cat([cond, mask], dim=1), image_BLE=image_BLE)

    def new_scheduler(self, steps: int, sampler=None, latents_BCFHW=None):
        scheduler = super().new_scheduler(steps, sampler, latents_BCFHW)
        if self.meanflow:  # what `timestep_r` looks a step's timestep up in (no host copy)
            timesteps = scheduler.timesteps
            self._schedule = (timesteps, torch.cat([timesteps[1:], timesteps.new_zeros(1)]))
        return scheduler

    def timestep_r(self, t: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor | None:
        """MeanFlow's second timestep for the step at `t`: the schedule's next timestep, 0 at the
        last (the pipeline's `timesteps[i + 1]`), found on the device by `t`'s value (the
        timesteps are distinct); None without MeanFlow."""
        if not self.meanflow:
            return None
        assert self._schedule is not None, "new_scheduler sets the schedule first"
        timesteps, after = (x.to(t.device) for x in self._schedule)
        return (after * (timesteps == t)).sum().expand(batch).to(dtype)

    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text: Hunyuan15Text, condition):
        """The prediction for `latents`: the noise joined on the channels by the condition
        latents and their mask, with the image's SigLIP tokens (image-to-video, `condition`),
        or by zeros, with zero image tokens that the model masks out (text-to-video)."""
        dtype = transformer.dtype
        latents = latents_BCFHW.to(dtype)
        B, C, F, H, W = latents.shape
        if condition is None:
            extra = latents.new_zeros(B, C + 1, F, H, W)
            image = latents.new_zeros(B, self.pipe.vision_num_semantic_tokens, transformer.config.image_embed_dim)
        else:
            extra, image = condition.latents_BCFHW.to(dtype), condition.image_BLE
        return transformer(
            hidden_states=torch.cat([latents, extra], dim=1),
            image_embeds=image,
            timestep=t.expand(B).to(dtype),
            timestep_r=self.timestep_r(t, B, dtype),
            return_dict=False,
            **text.inputs,
        )[0]
