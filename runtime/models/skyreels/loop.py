"""What the denoising loop asks of a loaded SkyReels-V2 checkpoint.

SkyReelsV2Pipeline and SkyReelsV2ImageToVideoPipeline are WanPipeline and Wan2.1's
WanImageToVideoPipeline with one transformer and no per-token timesteps: the same prompt
encoding, noise, image condition (VAE latents of the image and black frames, a first-frame
mask, CLIP's penultimate hidden states), transformer inputs, CFG and de-normalisation. So the
loop is the Wan family's (runtime/models/wan/loop.py), over SkyReels-V2's own pipeline
objects: they size the latents from the VAE's `temperal_downsample` and run its
`CLIPProcessor`, which stays byte-identical to diffusers. Their `__call__` is never used.
"""

from __future__ import annotations

import torch

from runtime.models.protocol import Variant
from runtime.models.skyreels.shapes import T2V
from runtime.models.wan.loop import WanModel


def register_blocks() -> None:
    """Make SkyReels-V2's blocks known to diffusers' first-block and MagCache hooks (--step-cache),
    which find what a block returns in a registry keyed by its class: diffusers (0.42) registers
    WanTransformerBlock but not this copy of it, and enabling the cache failed with "Model class
    SkyReelsV2TransformerBlock not registered". It returns what Wan's block returns."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2TransformerBlock

    try:
        TransformerBlockRegistry.get(SkyReelsV2TransformerBlock)
    except ValueError:
        metadata = TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None)
        TransformerBlockRegistry.register(model_class=SkyReelsV2TransformerBlock, metadata=metadata)


class SkyReelsModel(WanModel):
    """SkyReels-V2 text- or image-to-video (`variant`) as diffusers' SkyReels-V2 pipelines run it."""

    def __init__(self, components: dict, device: torch.device, max_text_len: int, variant: Variant | None = None):
        from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline

        self.device, self.max_text_len = device, max_text_len
        self.variant = variant = variant or T2V
        assert variant.experts == 1 and not variant.expand_timesteps, "SkyReels-V2 has one transformer"
        register_blocks()
        self.transformers = [components["transformer"]]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        common = {k: components[k] for k in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")}
        self.pipe = SkyReelsV2Pipeline(**common)
        self.pipe.set_progress_bar_config(disable=True)
        self.image_pipe = None
        if variant.image_pipeline():
            image = {k: components[k] for k in ("image_encoder", "image_processor")}
            self.image_pipe = SkyReelsV2ImageToVideoPipeline(**common, **image)
            self.image_pipe.set_progress_bar_config(disable=True)
