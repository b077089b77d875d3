"""Quality of an output against a reference run of the same item.

Frames are uint8 [F, H, W, 3]; latents are float tensors of equal shape.
- PSNR (dB) over all frames and channels, peak 255; identical frames give +inf, reported
  as None in JSON.
- SSIM: the standard form (Wang et al. 2004): Gaussian window 11x11, sigma 1.5,
  K1 = 0.01, K2 = 0.03, on each frame and channel at full resolution (valid window
  positions only), averaged. Written here in torch because the usual libraries
  (scikit-image) would add a large dependency for one function.
- latent relative error: ||a - b||_2 / ||b||_2 over the whole latent tensor.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def psnr(frames: np.ndarray, reference: np.ndarray) -> float:
    a = torch.from_numpy(frames).double()
    b = torch.from_numpy(reference).double()
    mse = torch.mean((a - b) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]  # [1, 1, size, size]


def ssim(frames: np.ndarray, reference: np.ndarray) -> float:
    """Mean SSIM over frames and channels; frames smaller than the window use a smaller one."""
    a = torch.from_numpy(frames).double().permute(0, 3, 1, 2).reshape(-1, 1, *frames.shape[1:3])
    b = torch.from_numpy(reference).double().permute(0, 3, 1, 2).reshape(-1, 1, *reference.shape[1:3])
    size = min(11, frames.shape[1], frames.shape[2])
    w = _gaussian_window(size, 1.5 * size / 11)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mu_a, mu_b = F.conv2d(a, w), F.conv2d(b, w)
    var_a = F.conv2d(a * a, w) - mu_a**2
    var_b = F.conv2d(b * b, w) - mu_b**2
    cov = F.conv2d(a * b, w) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.mean().item()


def latent_rel_err(latents: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.double()
    return ((latents.double() - ref).norm() / ref.norm()).item()


def quality_record(frames, ref_frames, latents, ref_latents, reference: str) -> dict:
    value = psnr(frames, ref_frames)
    return {
        "reference": reference,
        "psnr": None if math.isinf(value) else round(value, 4),  # None: identical frames
        "ssim": round(ssim(frames, ref_frames), 6),
        "latent_rel_err": latent_rel_err(latents, ref_latents),
    }
