"""The built-in model's VAE: diffusers' `AutoencoderKLWan` with weights set in closed form.

Latent space: each latent pixel is the 4x4 average of the RGB frames it covers, and each
latent frame keeps the four video frames of its chunk as four 3-channel slots (12 channels):
latent frame 0 holds video frame 0 (in every slot); latent frame i >= 1 holds frames
4i-3 .. 4i, slot k = frame 4i-3+k. Spatial factor 4, temporal factor 4, as Wan's VAE
arranges its chunks. `encode_video` computes the same thing directly (fast, for training).

Why closed form instead of trained weights: a trained tiny Wan VAE limits how exactly
colours come back (its decoder is the bottleneck of every quality number), and training it
costs most of the compute budget. These weights make `decode` an exact nearest-neighbour
upsampling of the slots and `encode` exact 4x4 pooling, through Wan's own layers:

- residual blocks and the mid attention have their output convs zeroed, so they are identities;
- convs use their centre spatial tap and the current-frame temporal tap as channel maps;
  the temporal resample convs (`time_conv`) route slots to output frames (decode) or
  frames to slots (encode), exactly the way Wan splits and merges chunks;
- `WanRMS_norm` at the head normalises over channels: a constant channel of size `K`
  dominates the norm, so it scales every content channel by the same factor (relative error
  below 1e-6), and a positive offset keeps the SiLU after it in its linear range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

SLOTS, RGB = 4, 3
Z_DIM = SLOTS * RGB  # latent channels
BASE_DIM = 32  # VAE width: channel CONST must fit in base_dim // 2 after each upsampling conv
CONST = 12  # the channel that carries the constant K
K = 1.0e4  # constant dominating the head's channel norm
OFFSET = 2.0  # content + OFFSET is in [1, 3]: SiLU is linear there after the gain below
GAIN = 50.0  # SiLU input = GAIN * (content + OFFSET) >= 50, where SiLU(x) == x in float32


def encode_video(video: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) in [-1, 1], T = 4n+1, H and W divisible by 4 -> (B, 12, n+1, H/4, W/4)."""
    b, c, t, h, w = video.shape
    assert c == RGB and (t - 1) % 4 == 0 and h % 4 == 0 and w % 4 == 0, video.shape
    pooled = F.avg_pool2d(video.transpose(1, 2).reshape(b * t, c, h, w), 4).view(b, t, c, h // 4, w // 4)
    first = pooled[:, :1].repeat(1, SLOTS, 1, 1, 1)  # (B, 4, 3, h, w): frame 0 in every slot
    rest = pooled[:, 1:].reshape(b, (t - 1) // 4, SLOTS, c, h // 4, w // 4)
    chunks = torch.cat([first.unsqueeze(1), rest], dim=1)  # (B, n+1, 4, 3, h, w)
    return chunks.flatten(2, 3).transpose(1, 2).contiguous()  # (B, 12, n+1, h, w)


def decode_latents(latents: torch.Tensor) -> torch.Tensor:
    """Inverse up to pooling: (B, 12, n+1, h, w) -> (B, 3, 4n+1, 4h, 4w), nearest upsampling."""
    b, _, n1, h, w = latents.shape
    slots = latents.view(b, SLOTS, RGB, n1, h, w).permute(0, 3, 1, 2, 4, 5)  # (B, n+1, 4, 3, h, w)
    frames = torch.cat([slots[:, 0, :1], slots[:, 1:].flatten(1, 2)], dim=1)  # (B, 4n+1, 3, h, w)
    frames = frames.transpose(1, 2)
    return F.interpolate(frames, scale_factor=(1, 4, 4), mode="nearest").clamp(-1, 1)


def build_vae(latents_mean: list[float], latents_std: list[float]) -> AutoencoderKLWan:
    vae = AutoencoderKLWan(
        base_dim=BASE_DIM,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        scale_factor_spatial=4,  # what WanPipeline sizes latents by
        latents_mean=latents_mean,
        latents_std=latents_std,
    )
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        _set_encoder(vae)
        _set_decoder(vae)
        _identity(vae.quant_conv, range(2 * Z_DIM))
        _identity(vae.post_quant_conv, range(Z_DIM))
    return vae.eval().requires_grad_(False)


# --- closed-form weights -------------------------------------------------------------------


def _tap(conv: torch.nn.Module) -> tuple:
    """Index of the centre spatial / current-frame temporal tap of a conv weight (out, in, ...)."""
    k = conv.weight.shape[2:]
    if len(k) == 3:  # causal 3D conv: the current frame is the last temporal tap
        return (k[0] - 1, k[1] // 2, k[2] // 2)
    return (k[0] // 2, k[1] // 2)


def _route(conv: torch.nn.Module, pairs, scale: float = 1.0, tap: tuple | None = None) -> None:
    """conv output channel o reads input channel i at one tap: (o, i) for each pair."""
    tap = _tap(conv) if tap is None else tap
    for o, i in pairs:
        conv.weight[(o, i, *tap)] = scale


def _identity(conv: torch.nn.Module, channels) -> None:
    _route(conv, [(c, c) for c in channels])


def _passthrough(module: torch.nn.Module) -> None:
    """Zero the branches of residual and attention blocks; identity 1x1 shortcuts."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    for block in module.modules():
        if isinstance(block, WanResidualBlock) and not isinstance(block.conv_shortcut, torch.nn.Identity):
            _identity(block.conv_shortcut, range(block.in_dim))


def _head_norm(norm: torch.nn.Module, channels) -> None:
    """gamma such that GAIN * x_c / K comes out of the norm for the content channels."""
    norm.gamma.zero_()
    for c in channels:
        norm.gamma[c] = GAIN * K / norm.scale


def _pool_2x2(conv: torch.nn.Conv2d, pairs) -> None:
    """Stride-2 3x3 conv after a right/bottom zero pad: taps (0..1, 0..1) average a 2x2 cell."""
    for o, i in pairs:
        conv.weight[o, i, :2, :2] = 0.25


def _set_encoder(vae: AutoencoderKLWan) -> None:
    enc = vae.encoder
    _passthrough(enc)
    _route(enc.conv_in, [(c, c) for c in range(RGB)])
    enc.conv_in.bias[:RGB] = OFFSET
    enc.conv_in.bias[CONST] = K
    resamples = [m for m in enc.down_blocks if hasattr(m, "time_conv")]
    assert len(resamples) == 2
    for stage, res in enumerate(resamples):
        width = RGB * 2**stage  # content channels entering this stage (1 frame, then 2 slots)
        conv = res.resample[1]
        # Spatial pooling; the content is also copied to the next `width` channels so that the
        # first chunk (which skips time_conv) carries its single frame in every slot.
        _pool_2x2(conv, [(c, c) for c in range(width)] + [(width + c, c) for c in range(width)] + [(CONST, CONST)])
        # time_conv sees (previous, a, b) with stride 2: slots (a, b) -> channels [0, width), [width, 2 width).
        _route(res.time_conv, [(c, c) for c in range(width)], tap=(1, 0, 0))
        _route(res.time_conv, [(width + c, c) for c in range(width)] + [(CONST, CONST)], tap=(2, 0, 0))
    _head_norm(enc.norm_out, range(Z_DIM))
    _route(enc.conv_out, [(c, c) for c in range(Z_DIM)], scale=1.0 / GAIN)
    enc.conv_out.bias[:Z_DIM] = -OFFSET
    enc.conv_out.bias[Z_DIM:] = -30.0  # log-variance: the posterior is its mean


def _set_decoder(vae: AutoencoderKLWan) -> None:
    dec = vae.decoder
    _passthrough(dec)
    _identity(dec.conv_in, range(Z_DIM))
    dec.conv_in.bias[CONST] = K
    ups = [blk.upsamplers[0] for blk in dec.up_blocks if blk.upsamplers is not None]
    assert len(ups) == 2
    for stage, res in enumerate(ups):
        width = Z_DIM // 2 ** (stage + 1)  # content channels per output frame after this stage
        dim = res.dim
        # time_conv writes two frames: channels [0, dim) then [dim, 2 dim); frame s takes slots s*width...
        _route(res.time_conv, [(s * dim + c, s * width + c) for s in range(2) for c in range(width)])
        _route(res.time_conv, [(s * dim + CONST, CONST) for s in range(2)])
        conv = res.resample[1]
        _identity(conv, [*range(width), CONST])
        if stage == len(ups) - 1:
            conv.bias[:RGB] = OFFSET
    _head_norm(dec.norm_out, range(RGB))
    _route(dec.conv_out, [(c, c) for c in range(RGB)], scale=1.0 / GAIN)
    dec.conv_out.bias[:] = -OFFSET
