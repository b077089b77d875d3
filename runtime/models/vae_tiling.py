"""Tiles of a diffusers video VAE that has diffusers' tiling settings (`enable_tiling` with
`tile_sample_min_height` and `tile_sample_stride_height`, and `spatial_compression_ratio`): the
`tiling` of the families whose VAE decodes so (runtime/vae.py asks the family)."""

from __future__ import annotations

from runtime.models.protocol import Tiling

# diffusers' tile defaults: 256-pixel tiles every 192 pixels (a quarter overlaps, and is blended).
STRIDE_FRACTION = 0.75


def diffusers_tiling(vae, tiled: bool, px: int | None) -> Tiling:
    """Set the VAE's tiling as diffusers does (`px`: a tile's side, None: the VAE's default) and
    say it; `tiled` False: tiling off, one tile per frame chunk."""
    if not tiled:
        vae.disable_tiling()
    elif px is None:
        vae.enable_tiling()
    else:
        px, stride = aligned(px, vae.spatial_compression_ratio)
        vae.enable_tiling(
            tile_sample_min_height=px,
            tile_sample_min_width=px,
            tile_sample_stride_height=stride,
            tile_sample_stride_width=stride,
        )
    return Tiling(
        bool(vae.use_tiling),
        vae.tile_sample_min_height,
        vae.tile_sample_stride_height,
        vae.spatial_compression_ratio,
        vae.config.get("patch_size") or 1,
    )


def aligned(px: int, ratio: int) -> tuple[int, int]:
    """(side, stride) in pixels of `px`-pixel tiles on a VAE `ratio` pixels a latent: whole latents
    both (at least two a side, one a stride), the stride the largest under three quarters of the
    side. diffusers' grid steps by whole latents while it crops and blends in pixels: a side or
    stride between latents (--vae-tile 16 on an 8x VAE: 12; 64 on LTX-2's 32x: 48) overlapped the
    tiles wrongly."""
    side = max(2 * ratio, px - px % ratio)
    return side, max(ratio, int(side * STRIDE_FRACTION) // ratio * ratio)
