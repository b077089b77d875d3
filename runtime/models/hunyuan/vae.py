"""The HunyuanVideo VAE's decode, as runtime/vae.py tiles and spreads it (diffusers'
`AutoencoderKLHunyuanVideo._temporal_tiled_decode`)."""

from __future__ import annotations

import torch


def vae_chunks(vae, frames: int) -> list[slice]:
    """Overlapping chunks of latent frames (one shared) when framewise decoding is on, as
    diffusers' `_temporal_tiled_decode`."""
    if not vae.use_framewise_decoding:
        return [slice(0, frames)]
    ratio = vae.temporal_compression_ratio
    min_f, stride_f = vae.tile_sample_min_num_frames // ratio, vae.tile_sample_stride_num_frames // ratio
    if frames <= min_f:
        return [slice(0, frames)]
    return [slice(i, min(i + min_f + 1, frames)) for i in range(0, frames, stride_f)]


def decode_tile(vae, z_BCFHW: torch.Tensor) -> torch.Tensor:
    return vae.decoder(vae.post_quant_conv(z_BCFHW))


def join_chunks(vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor:
    """The video [B, C, F, H, W] from the blended chunks: each after the first loses its shared
    frame and is blended in time with the one before (diffusers' `blend_t`)."""
    if len(chunks) == 1:
        return chunks[0]
    ratio = vae.temporal_compression_ratio
    blend_f = vae.tile_sample_min_num_frames - vae.tile_sample_stride_num_frames
    stride_f = vae.tile_sample_stride_num_frames
    chunks = [c if i == 0 else c[:, :, 1:] for i, c in enumerate(chunks)]
    out = []
    for i, chunk in enumerate(chunks):
        if i > 0:
            chunk = vae.blend_t(chunks[i - 1], chunk, blend_f)
        out.append(chunk[:, :, : stride_f + (1 if i == 0 else 0)])
    return torch.cat(out, dim=2)[:, :, : (frames - 1) * ratio + 1]
