"""Small PNG figures written without a plotting library (imageio + numpy only); labels use
a built-in 3x5 pixel font."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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


# A 3x5 pixel font for plot labels: each glyph is 5 rows of 3 bits, top row first.
# Lower-case letters are drawn as upper-case; a character not listed is drawn as a space.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "+": "000010111010000", "=": "000111000111000", "%": "101001010100101", ":": "000010000010000",
    "_": "000000000000111", "/": "001001010100100", "(": "010100100100010", ")": "010001001001010",
    " ": "000000000000000",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011", "D": "110101101101110",
    "E": "111100110100111", "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010", "P": "110101110100100",
    "Q": "010101101110011", "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
}  # fmt: skip


def text_width(text: str, scale: int = 2) -> int:
    """Pixels `draw_text` covers horizontally (4 columns a character, the last gap included)."""
    return 4 * scale * len(text)


def draw_text(img: np.ndarray, x: int, y: int, text: str, rgb, scale: int = 2) -> None:
    """Draw `text` into img [H, W, 3] uint8 with its top-left corner at (x, y); clipped at the edges."""
    h, w, _ = img.shape
    for i, ch in enumerate(text.upper()):
        bits = _FONT.get(ch, _FONT[" "])
        for k, bit in enumerate(bits):
            if bit == "1":
                px, py = x + (4 * i + k % 3) * scale, y + (k // 3) * scale
                if 0 <= px < w and 0 <= py < h:
                    img[py : min(h, py + scale), px : min(w, px + scale)] = rgb


def _line(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, rgb, dash: int = 0) -> None:
    """A 1-px line from (x0, y0) to (x1, y1); dash > 0 leaves every other `dash` pixels out."""
    h, w, _ = img.shape
    n = max(abs(x1 - x0), abs(y1 - y0), 1)
    for j in range(n + 1):
        if dash and (j // dash) % 2:
            continue
        x, y = x0 + (x1 - x0) * j // n, y0 + (y1 - y0) * j // n
        if 0 <= x < w and 0 <= y < h:
            img[y, x] = rgb


def _ticks(lo: float, hi: float, count: int = 8) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    raw = (hi - lo) / max(1, count)
    step = 10 ** np.floor(np.log10(raw)) if raw > 0 else 1.0
    step *= next((m for m in (1, 2, 5, 10) if m * step >= raw), 10)
    first = np.ceil(lo / step - 1e-9) * step
    return [round(float(v), 9) + 0.0 for v in np.arange(first, hi + step * 1e-9, step)]  # + 0.0: no "-0"


@dataclass(frozen=True)
class Series:
    """Points (x, y, label) of one series of `write_xy_plot`; label "" draws none. y = +inf
    is drawn at the top edge of the plot area (an identical output, e.g. PSNR)."""

    name: str
    points: list[tuple[float, float, str]]
    joined: bool = True  # a line through the points in x order; False: markers only
    marker: Literal["square", "cross"] = "square"


def write_xy_plot(
    path: Path,
    series: list[Series],
    hline: float | None = None,
    x_range: tuple[float, float] | None = None,
    x_label: str = "",
    y_label: str = "",
    width: int = 560,
    height: int = 380,
) -> None:
    """A line / scatter plot: one ramp colour per series, its name in a legend along the top
    (after the y title), each point's label beside it, tick values on both axes, axis titles (x below the
    axis, y above it), and an optional dashed horizontal reference line at y = hline. Axes
    span x_range (default: 0 to the largest x) and the finite y values and hline, padded."""
    left, right, top, bottom = 56, 16, 24, 44
    img = np.full((height, width, 3), 24, dtype=np.uint8)
    pts = [(x, y) for s in series for x, y, _ in s.points]
    xs = [x for x, _ in pts]
    ys = [y for _, y in pts if np.isfinite(y)] + ([hline] if hline is not None else [])
    x_lo, x_hi = x_range or (0.0, max(xs, default=1.0) or 1.0)
    y_lo, y_hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    pad = 0.08 * (y_hi - y_lo) or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> int:
        return left + int(round((x - x_lo) / (x_hi - x_lo) * plot_w))

    def py(y: float) -> int:
        return top + (0 if not np.isfinite(y) else int(round((y_hi - y) / (y_hi - y_lo) * plot_h)))

    axis, grid, label = (150, 150, 150), (48, 48, 48), (200, 200, 200)
    for v in _ticks(x_lo, x_hi):
        _line(img, px(v), top, px(v), top + plot_h, grid)
        text = f"{v:g}"
        draw_text(img, px(v) - text_width(text) // 2, top + plot_h + 6, text, label)
    for v in _ticks(y_lo, y_hi):
        _line(img, left, py(v), left + plot_w, py(v), grid)
        text = f"{v:g}"
        draw_text(img, left - 6 - text_width(text), py(v) - 5, text, label)
    draw_text(img, left + plot_w - text_width(x_label), height - 12, x_label, label)
    draw_text(img, 4, 4, y_label, label)
    _line(img, left, top + plot_h, left + plot_w, top + plot_h, axis)
    _line(img, left, top, left, top + plot_h, axis)
    if hline is not None:
        _line(img, left, py(hline), left + plot_w, py(hline), (230, 90, 90), dash=4)
    colours = colour(np.linspace(0.45, 1.0, max(1, len(series))))
    legend_x = 4 + text_width(y_label) + 24
    for i, s in enumerate(series):
        rgb = colours[i]
        points = [(px(x), py(y), lab) for x, y, lab in sorted(s.points)]
        if s.joined:
            for (x0, y0, _), (x1, y1, _) in zip(points, points[1:], strict=False):
                _line(img, x0, y0, x1, y1, rgb)
        for x, y, lab in points:
            _marker(img, x, y, s.marker, rgb)
            draw_text(img, x + 6, y - 12, lab, rgb)
        _marker(img, legend_x + 4, 8, s.marker, rgb)  # the legend: one row in the top margin
        draw_text(img, legend_x + 12, 4, s.name, rgb)
        legend_x += 12 + text_width(s.name) + 16
    write_png(path, img)


def _marker(img: np.ndarray, x: int, y: int, marker: str, rgb) -> None:
    h, w, _ = img.shape
    if marker == "square":
        img[max(0, y - 3) : y + 4, max(0, x - 3) : x + 4] = rgb
        return
    for d in range(-4, 5):  # a cross
        for dx, dy in ((d, d), (d, -d)):
            if 0 <= y + dy < h and 0 <= x + dx < w:
                img[y + dy, x + dx] = rgb
