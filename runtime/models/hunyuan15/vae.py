"""The HunyuanVideo-1.5 VAE's decode as runtime/vae.py tiles and spreads it
(`AutoencoderKLHunyuanVideo15.tiled_decode`): spatial tiles only, the whole clip in each."""

from __future__ import annotations

import torch

from runtime.models.protocol import Tiling
from runtime.models.vae_tiling import STRIDE_FRACTION


def tiling(vae, tiled: bool, px: int | None) -> Tiling:
    """The VAE's tiles: its own settings (a side and an overlap factor, in pixels and latents),
    set from `px` as a side with diffusers' quarter overlap, rounded down to a multiple of 4
    latents (64 pixels at 16x; 4 at least). `tiled_decode` steps int(3/4) of the latent side but
    keeps 3/4 of the pixel side: the two agree only there. Another side made its frames the
    wrong size, and a side under 2 latents a zero step (--vae-tile 16 failed: "range() arg 3
    must not be zero")."""
    ratio = vae.spatial_compression_ratio
    if not tiled:
        vae.disable_tiling()
    elif px is None:
        vae.enable_tiling()
    else:
        latent = max(4, px // ratio // 4 * 4)
        vae.enable_tiling(
            tile_sample_min_height=latent * ratio,
            tile_sample_min_width=latent * ratio,
            tile_latent_min_height=latent,
            tile_latent_min_width=latent,
            tile_overlap_factor=1 - STRIDE_FRACTION,
        )
    stride = int(vae.tile_latent_min_height * (1 - vae.tile_overlap_factor))  # in latents, as tiled_decode steps
    return Tiling(bool(vae.use_tiling), vae.tile_sample_min_height, stride * ratio, ratio)


def vae_chunks(vae, frames: int) -> list[slice]:
    """Every latent frame in one pass (the decoder has no frame chunks)."""
    return [slice(0, frames)]


def decode_tile(vae, z_BCFHW: torch.Tensor) -> torch.Tensor:
    return vae.decoder(z_BCFHW)


def join_chunks(vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor:
    (video,) = chunks
    return video
