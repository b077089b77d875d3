"""Quality metrics against known values."""

from __future__ import annotations

import math

import numpy as np
import torch

from runtime.quality import latent_rel_err, psnr, quality_record, ssim


def test_psnr_known_value():
    a = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    b = a.copy()
    b[..., 0] = 10  # MSE = 100 / 3 over all channels
    assert math.isclose(psnr(b, a), 10 * math.log10(255**2 / (100 / 3)), rel_tol=1e-12)
    assert psnr(a, a) == math.inf


def test_ssim_identity_and_degradation():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    assert math.isclose(ssim(img, img), 1.0, abs_tol=1e-12)
    noisy = np.clip(img.astype(int) + rng.normal(0, 20, img.shape), 0, 255).astype(np.uint8)
    very = np.clip(img.astype(int) + rng.normal(0, 60, img.shape), 0, 255).astype(np.uint8)
    assert 1.0 > ssim(noisy, img) > ssim(very, img) > 0.0
    # Constant images: luminance term only, (2*mu_a*mu_b + c1) / (mu_a^2 + mu_b^2 + c1).
    a, b = np.full((1, 16, 16, 3), 100, np.uint8), np.full((1, 16, 16, 3), 110, np.uint8)
    c1 = (0.01 * 255) ** 2
    assert math.isclose(ssim(a, b), (2 * 100 * 110 + c1) / (100**2 + 110**2 + c1), rel_tol=1e-9)


def test_latent_rel_err_and_record():
    ref = torch.ones(1, 4, 2, 2, 2)
    assert math.isclose(latent_rel_err(ref * 1.1, ref), 0.1, rel_tol=1e-6)
    frames = np.zeros((1, 16, 16, 3), np.uint8)
    record = quality_record(frames, frames, ref, ref, "exact")
    assert record == {"reference": "exact", "psnr": None, "ssim": 1.0, "latent_rel_err": 0.0}
