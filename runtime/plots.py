"""The PNG figures of a run (each item's plan heatmap and per-step plot) and of the benchmarks,
drawn with matplotlib's object API on its Agg canvas: no pyplot, no global backend, so a
caller's own matplotlib set-up is left alone. Every file is written under a partial name and
renamed (runtime/video.py)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from runtime.video import write_bytes

DPI = 110
MARKERS = {"square": "s", "cross": "x"}


def _figure(width_in: float = 6.4, height_in: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes(path, buffer.getvalue())


def write_heatmap(path: Path, values_SL: np.ndarray) -> None:
    """DiTango's compute map: [steps, layers] fractions in [0, 1] of the attention computed
    fresh (1) rather than reused from the cache (0); steps along x, layer 0 at the top."""
    steps, layers = values_SL.shape
    fig = _figure(max(4.0, min(12.0, 1.5 + steps * 0.12)), max(2.4, min(8.0, 1.2 + layers * 0.18)))
    ax = fig.add_subplot()
    image = ax.imshow(
        values_SL.T,
        aspect="auto",
        cmap="viridis",
        vmin=0.0,
        vmax=1.0,
        interpolation="nearest",
        extent=(0.5, steps + 0.5, layers - 0.5, -0.5),
    )
    ax.set_xlabel("denoising step")
    ax.set_ylabel("transformer layer")
    ax.set_title("attention computed per step and layer")
    bar = fig.colorbar(image, ax=ax)
    bar.set_label("fraction computed")
    _save(fig, path)


def write_rel_mae_plot(path: Path, rel_mae: list[float | None], stages: list[str]) -> None:
    """Hybridiff's monitor over steps: the relative mean absolute difference M between the
    conditional and unconditional predictions, with each step's stage as a coloured band."""
    fig = _figure()
    ax = fig.add_subplot()
    steps = np.arange(1, len(rel_mae) + 1)
    values = np.array([np.nan if v is None else v for v in rel_mae], dtype=np.float64)
    ax.plot(steps, values, marker="o", markersize=3, color="black", label="M (cond vs uncond)")
    names = list(dict.fromkeys(stages))
    palette = ["#cfe2f3", "#fce5cd", "#d9ead3", "#ead1dc", "#fff2cc"]
    for k, name in enumerate(names):
        for i, stage in enumerate(stages):
            if stage == name:
                ax.axvspan(
                    i + 0.5,
                    i + 1.5,
                    color=palette[k % len(palette)],
                    lw=0,
                    label=f"stage: {name}" if i == stages.index(name) else None,
                )
    ax.set_xlabel("denoising step")
    _integer_steps(ax)
    ax.set_ylabel("relative MAE M (unitless)")
    ax.set_title("Hybridiff: CFG branches' difference per step")
    ax.legend(loc="best", fontsize="small")
    _save(fig, path)


def write_step_plot(
    path: Path,
    step_s: list[float],
    computed: list[float] | None = None,
    kinds: list[str] | None = None,
    rel_err: list[float] | None = None,
) -> None:
    """An item's steps: the time of each (s); with DiTango the share of attention it computed
    fresh, anchors and exact steps marked; with --reference exact, below, how far its latents
    are from the exact run's after each step (relative L2, log scale): what speed cost in quality."""
    fig = _figure(8.4, 5.6 if rel_err else 3.6)
    ax = fig.add_subplot(2, 1, 1) if rel_err else fig.add_subplot()
    steps = np.arange(1, len(step_s) + 1)
    ax.plot(steps, step_s, marker="o", markersize=3, color="#1f4e79", label="step time (s)")
    ax.set_xlabel("denoising step")
    _integer_steps(ax)
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    if computed:
        right = ax.twinx()
        right.step(
            np.arange(1, len(computed) + 1),
            computed,
            where="mid",
            color="#b45f06",
            label="attention computed (fraction)",
        )
        right.set_ylabel("attention computed (fraction)")
        right.set_ylim(0, 1.05)
        for kind, mark in (("anchor", "^"), ("exact", "s")):
            at = [i + 1 for i, k in enumerate(kinds or []) if k == kind]
            if at:
                right.scatter(
                    at, [computed[i - 1] for i in at], marker=mark, color="#b45f06", s=18, label=f"{kind} step"
                )
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.set_title("per step")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.13 if computed else 1.02, 1), fontsize="small")
    if rel_err:
        low = fig.add_subplot(2, 1, 2, sharex=ax)
        errors = np.array(rel_err, dtype=np.float64)
        shown = np.where(errors > 0, errors, np.nan)  # identical steps have no place on a log scale
        low.plot(
            np.arange(1, len(rel_err) + 1),
            shown,
            marker="o",
            markersize=3,
            color="#990000",
            label="latents vs exact run (relative L2)",
        )
        if np.isfinite(shown).any():
            low.set_yscale("log")
        low.set_xlabel("denoising step")
        low.set_ylabel("relative error (unitless)")
        low.set_title("quality per step: distance from the exact run")
        low.legend(loc="best", fontsize="small")
    _save(fig, path)


def write_bars(path: Path, labels: list[str], series: dict[str, list[float]], y_label: str, title: str) -> None:
    """Grouped bars: one group per label (a table row), one bar per series, with a legend."""
    fig = _figure(max(6.4, 1.2 + 0.7 * len(labels)), 3.8)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for k, (name, values) in enumerate(series.items()):
        ax.bar(x + (k - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize="small")
    ax.set_ylabel(y_label)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize="small")
    _save(fig, path)


@dataclass
class Series:
    name: str
    points: list[tuple[float, float, str]]  # (x, y, label); y may be inf (drawn at the top, labelled)
    joined: bool = True  # a line through the points in x order; False: markers only
    marker: Literal["square", "cross"] = "square"


def write_xy_plot(
    path: Path,
    series: list[Series],
    hline: float | None = None,
    x_range: tuple[float, float] | None = None,
    x_label: str = "",
    y_label: str = "",
    title: str = "",
) -> None:
    """Series of labelled points (a line through them unless `joined` is False), an optional
    dashed reference line at y = hline, a legend. Labels alternate above and below their
    point so neighbours do not overlap; an infinite y is drawn at the top of the axes."""
    fig = _figure(7.2, 4.4)
    ax = fig.add_subplot()
    finite = [y for s in series for _, y, _ in s.points if math.isfinite(y)] + ([hline] if hline is not None else [])
    top = (max(finite) if finite else 1.0) + 0.08 * ((max(finite) - min(finite)) if finite else 1.0) + 0.5
    labels = []
    for s in series:
        pts = sorted(s.points)
        xs = [x for x, _, _ in pts]
        ys = [y if math.isfinite(y) else top for _, y, _ in pts]
        style = "-" if s.joined else "none"
        (line,) = ax.plot(xs, ys, linestyle=style, marker=MARKERS[s.marker], label=s.name)
        labels += [(x, y, label, line.get_color()) for x, y, (_, _, label) in zip(xs, ys, pts, strict=True)]
    if hline is not None:
        ax.axhline(hline, linestyle="--", color="#c00000", linewidth=1, label=f"{hline:g} reference")
    if x_range is not None:
        ax.set_xlim(*x_range)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    _place_labels(fig, ax, labels)
    _save(fig, path)


# Where a point's label may go, in points from the point: above, below, right, left, then the diagonals.
OFFSETS = [(0, 7), (0, -13), (8, -3), (-8, -3), (8, 7), (-8, 7), (8, -13), (-8, -13), (0, 18), (0, -24)]


def _place_labels(fig, ax, labels: list[tuple[float, float, str, str]]) -> None:
    """Each label at the first offset where it overlaps no label placed before it and no
    marker (a greedy placement: labels stay beside their point and never cover each other)."""
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()  # the layout's final axes, so positions in pixels are final
    taken = []
    for x, y, _, _ in labels:  # the markers themselves
        px, py = ax.transData.transform((x, y))
        taken.append((px - 4, py - 4, px + 4, py + 4))
    for x, y, text, colour in labels:
        for dx, dy in OFFSETS:
            ha = "center" if dx == 0 else "left" if dx > 0 else "right"
            note = ax.annotate(
                text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=7, color=colour
            )
            box = note.get_window_extent(renderer)
            edges = (box.x0, box.y0, box.x1, box.y1)
            if not any(a0 < edges[2] and edges[0] < a1 and b0 < edges[3] and edges[1] < b1 for a0, b0, a1, b1 in taken):
                break
            note.remove()
        else:
            note = ax.annotate(
                text, (x, y), textcoords="offset points", xytext=OFFSETS[0], ha="center", fontsize=7, color=colour
            )
            box = note.get_window_extent(renderer)
            edges = (box.x0, box.y0, box.x1, box.y1)
        taken.append(edges)
