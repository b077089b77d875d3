"""The VAE decode's working set per GPU (float32), for planner/memory.py.

The decode runs as diffusers runs it, distributed by runtime/vae.py: untiled, or diffusers'
tiles (side `tile_px`, every 3/4 of it) spread over `ranks` ranks, the writer (rank 0)
receiving every tile and blending them.

Per decoder call on a latent region h x w (one tile, or the whole frame):
  caches       Wan's causal convolutions keep the last CACHE_T frames of each input between
               frame chunks: CACHE_T x 4 x sum over resolutions of cached channels x area;
  activations  the VAE's activation_factor x the widest (channels x frames x area x 4) over the
               decoder's resolutions: a residual block holds its input, the normed copy,
               the padded convolution input and the output at once;
  mask         HunyuanVideo's mid-block attention builds a dense causal mask over the call's
               N latent tokens: a bool comparison and the float32 mask, 5 N^2 bytes.
Outputs: each call's decoded frames are held until the end (Wan's frame-chunk concatenation,
diffusers' tile and frame-chunk lists), then blended into the video (3 x frames x H x W x 4),
which the clamp copies once more.

Calibration (benchmarks/memory.py, CPU, Wan2.1's and HunyuanVideo's VAEs untiled and tiled):
within 12.5% of the measured peak, mean 9.5%; CUDA convolution workspaces are not modelled.

Legend: f, h, w latent frames / height / width; F, H, W the video's.
"""

from __future__ import annotations

from planner.models import VaeShape

CACHE_T = 2  # diffusers' autoencoder_kl_wan.CACHE_T
F32 = 4


def level_frames(vae: VaeShape, frames: int) -> list[int]:
    """Frames of a call of `frames` latent frames at each decoder resolution. Wan's temporal
    upsampler doubles a (non-first) chunk's frames; HunyuanVideo's keeps the first and
    doubles the rest (f -> 2f - 1)."""
    out = [frames]
    for grows in vae.time_up[:-1]:
        f = out[-1]
        out.append((2 * f if vae.causal_frames else 2 * f - 1) if grows else f)
    return out


def output_frames(vae: VaeShape, latent_frames: int) -> int:
    return (latent_frames - 1) * vae.temporal + 1


def call_bytes(vae: VaeShape, frames: int, h: int, w: int) -> tuple[int, int]:
    """(caches, activations + mask) of one decoder call on `frames` latent frames of h x w."""
    areas = [h * w * 4**i for i in range(len(vae.widths))]
    caches = CACHE_T * F32 * sum(c * a for c, a in zip(vae.cached, areas, strict=True))
    act = max(c * f * a for c, f, a in zip(vae.widths, level_frames(vae, frames), areas, strict=True))
    mask = 5 * (frames * h * w) ** 2 if vae.masked_attention else 0
    return caches, round(vae.activation_factor * F32 * act) + mask


def chunks(vae: VaeShape, f: int) -> list[int]:
    """Latent frames of each decoder call along time: Wan one at a time; HunyuanVideo diffusers'
    overlapping chunks (one latent frame shared) once the video is longer than one chunk."""
    if vae.causal_frames:
        return [1] * f
    n = vae.chunk_frames
    if f <= n - 1:
        return [f]
    return [min(n, f - i) for i in range(0, f, vae.chunk_stride)]


def tile_grid(vae: VaeShape, h: int, w: int, tile_px: int) -> list[tuple[int, int]]:
    """(rows, cols) of each latent tile, diffusers' grid (edge tiles clipped)."""
    size, stride = max(1, tile_px // vae.spatial), max(1, tile_px * 3 // 4 // vae.spatial)
    if h <= size and w <= size:
        return [(h, w)]
    return [(min(size, h - i), min(size, w - j)) for i in range(0, h, stride) for j in range(0, w, stride)]


def decode_bytes(
    vae: VaeShape, latent: tuple[int, int, int], tiled: bool, tile_px: int, ranks: int = 1, rank: int | None = None
) -> int:
    """The largest decode working set of any rank (outputs and video included); `rank`: that
    rank's of a tiled decode over `ranks`."""
    f, h, w = latent
    s = vae.spatial
    video = 3 * output_frames(vae, f) * h * s * w * s * F32
    calls = chunks(vae, f)
    if vae.causal_frames:  # the first chunk decodes to 1 frame, every other to `temporal`
        decoded = output_frames(vae, f)
    else:  # diffusers' chunks overlap by one latent frame
        decoded = sum(level_frames(vae, c)[-1] for c in calls)

    def region(th: int, tw: int) -> tuple[int, int, int]:
        """(caches, largest call, decoded output) of a latent region over all its calls."""
        work = [call_bytes(vae, c, th, tw) for c in set(calls)]
        return max(c for c, _ in work), max(a for _, a in work), 3 * decoded * th * s * tw * s * F32

    if not tiled:
        caches, act, out = region(h, w)
        # the last call beside what is decoded so far; then the final concatenation (Wan) or
        # blend (HunyuanVideo) makes the video beside it, and the clamp copies it once more
        return caches + out + max(act, video)
    tiles = [region(th, tw) for th, tw in tile_grid(vae, h, w, tile_px)]
    worst = 0
    for r in range(max(1, ranks)) if rank is None else [rank]:
        mine = tiles[r::ranks]
        own = sum(out for _, _, out in mine)
        # a tile's calls beside the rank's earlier tiles; its frames concatenated at the end
        decoding = own + max((c + max(a, out) for c, a, out in mine), default=0)
        if r == 0:  # the writer: every tile, then the blended rows and the video
            worst = max(worst, decoding, sum(out for _, _, out in tiles) + 2 * video)
        else:  # its tiles, then one flat copy of them to send
            worst = max(worst, decoding, 2 * own)
    return worst
