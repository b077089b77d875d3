"""Small PNG figures written without a plotting library (imageio + numpy only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.video import write_png

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
    write_png(path, img)


def write_rel_mae_plot(
    path: Path, rel_mae: list[float | None], stages: list[str], cell: int = 14, height: int = 120
) -> None:
    """Hybridiff's monitor M over steps (white dots joined by a line; gaps where no value),
    pipeline steps shaded light blue, the fill step darker; y from 0 to max M."""
    steps = len(stages)
    width = max(1, steps) * cell
    img = np.full((height, width, 3), 24, dtype=np.uint8)
    shade = {"pipeline": (70, 110, 160), "pipeline-fill": (40, 70, 120)}
    for i, stage in enumerate(stages):
        if stage in shade:
            img[:, i * cell : (i + 1) * cell] = shade[stage]
    values = [m for m in rel_mae if m is not None]
    top = max(values) if values and max(values) > 0 else 1.0
    points = [
        None if m is None else (i * cell + cell // 2, int(round((height - 6) - (m / top) * (height - 12))))
        for i, m in enumerate(rel_mae)
    ]
    for a, b in zip(points, points[1:], strict=False):
        if a is None or b is None:  # no line across steps without a value
            continue
        (x0, y0), (x1, y1) = a, b
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for j in range(n + 1):
            x = x0 + (x1 - x0) * j // n
            y = y0 + (y1 - y0) * j // n
            img[max(0, y - 0) : y + 1, x : x + 1] = (200, 200, 200)
    for x, y in (p for p in points if p is not None):
        img[max(0, y - 2) : y + 3, max(0, x - 2) : x + 3] = (255, 255, 255)
    write_png(path, img)


def write_bars(path: Path, groups: list[list[float]], bar: int = 14, gap: int = 10, height: int = 160) -> None:
    """Grouped bar chart without text: one group per table row (left to right, in row
    order), one bar per series inside a group (ramp colours); heights scaled to the max."""
    top = max((v for g in groups for v in g), default=0.0) or 1.0
    n = max((len(g) for g in groups), default=1)
    width = len(groups) * (n * bar + gap) + gap
    img = np.full((height, width, 3), 24, dtype=np.uint8)
    colours = colour(np.linspace(0.15, 1.0, n))
    for i, g in enumerate(groups):
        x0 = gap + i * (n * bar + gap)
        for j, v in enumerate(g):
            h = int(round((height - 8) * max(0.0, v) / top))
            if h:
                img[height - 4 - h : height - 4, x0 + j * bar : x0 + (j + 1) * bar - 2] = colours[j]
    write_png(path, img)
