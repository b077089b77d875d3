"""The LTX-2 VAE's decode as runtime/vae.py tiles and spreads it (`AutoencoderKLLTX2Video`'s
spatial `tiled_decode`): diffusers' tile settings, the whole clip in each tile (its decoder pads
causally in time, with no caches to carry between frame chunks), pixels out of the decoder."""

from __future__ import annotations

from dataclasses import replace

import torch

from runtime.models.protocol import Tiling
from runtime.models.vae_tiling import diffusers_tiling


def tiling(vae, tiled: bool, px: int | None) -> Tiling:
    """diffusers' tiles; the decoder un-patches its output itself (its `patch_size` is the
    encoder's input patch, not blocks of output channels). A reflect-padded decoder (LTX-2's)
    cannot take a tile one latent wide, which diffusers' grid makes where a side is one more than
    a multiple of the stride (480 px: 15 latents, tiles at 0 and 14): that tile is left out."""
    reflect = vae.config.get("decoder_spatial_padding_mode") == "reflect"
    return replace(diffusers_tiling(vae, tiled, px), patch=1, min_side=2 if reflect else 1)


def vae_chunks(vae, frames: int) -> list[slice]:
    """Every latent frame in one pass."""
    return [slice(0, frames)]


def decode_tile(vae, z_BCFHW: torch.Tensor) -> torch.Tensor:
    return vae.decoder(z_BCFHW, None)


def join_chunks(vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor:
    (video,) = chunks
    return video
