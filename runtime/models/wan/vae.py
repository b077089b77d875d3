"""The Wan VAE's decode, as runtime/vae.py tiles and spreads it (`AutoencoderKLWan.tiled_decode`)."""

from __future__ import annotations

import torch


def vae_chunks(vae, frames: int) -> list[slice]:
    """Wan decodes every latent frame in one pass through its causal caches."""
    return [slice(0, frames)]


def decode_tile(vae, z_BCFHW: torch.Tensor) -> torch.Tensor:
    """The decoder's output for one tile, frame by frame through the causal caches as
    `AutoencoderKLWan.tiled_decode` does (before blending, unpatchify and clamp)."""
    vae.clear_cache()
    out = []
    for k in range(z_BCFHW.shape[2]):
        vae._conv_idx = [0]
        x = vae.post_quant_conv(z_BCFHW[:, :, k : k + 1])
        out.append(vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
    vae.clear_cache()
    return torch.cat(out, dim=2)


def join_chunks(vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor:
    """The video [B, C, F, H, W] from the blended chunks: unpatchified (Wan2.2's VAE) and clamped."""
    video = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
    patch = vae.config.patch_size
    if patch is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        video = unpatchify(video, patch_size=patch)
    return torch.clamp(video, min=-1.0, max=1.0)
