"""Small PNG figures written without a plotting library (imageio + numpy only)."""

from __future__ import annotations

from pathlib import Path

import imageio.v2 as imageio
import numpy as np

# A perceptually ordered ramp (dark blue -> teal -> yellow), like viridis; 0 = reused, 1 = computed.
_RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)


def colour(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to RGB uint8 along the ramp."""
    x = np.clip(values, 0.0, 1.0) * (len(_RAMP) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_RAMP) - 2)
    t = (x - lo)[..., None]
    return (_RAMP[lo] * (1 - t) + _RAMP[lo + 1] * t).round().astype(np.uint8)


def write_heatmap(path: Path, values_SL: np.ndarray, cell: int = 12) -> None:
    """values [steps, layers] in [0, 1] -> PNG with steps along x (left to right) and
    layers along y (layer 0 at the top), one `cell`-pixel square each, 1 px grid."""
    steps, layers = values_SL.shape
    rgb = colour(values_SL.T)  # [layers, steps, 3]
    img = np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)
    img[::cell, :, :] = 255
    img[:, ::cell, :] = 255
    tmp = path.with_name(path.name + ".partial.png")
    imageio.imwrite(tmp, img)
    tmp.replace(path)
