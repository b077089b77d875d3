"""Prompt adherence of a decoded video: which colour, shape and background, moving which way.

Reads frames only (what a viewer sees), so it scores any model's output the same way:

- background: the median colour of the frame borders, matched to the nearest named one;
- object: the largest 4-connected blob of pixels whose colour is far from that background
  (scattered speckles are not an object); its colour is the median of the blob's core
  pixels (edges blend with the background), matched to the nearest name;
- direction: the object's centroid path, from a least-squares line through the per-frame
  centroids; the axis and sign of the larger displacement; under `MIN_TRAVEL` of the frame
  it is "none" (no visible motion);
- shape: how much of its bounding box the object fills (a square ~1, a circle ~pi/4).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tiny_wan.data import BACKGROUNDS, COLOURS, DIRECTIONS, PromptSpec

OBJECT_DIST = 0.25  # RGB distance (in [0, 1] units) from the background that marks object pixels
MIN_AREA = 0.02  # a blob smaller than this fraction of the frame is not an object (82 px at 64x64;
# the smallest dataset object covers ~200 px)
MIN_PRESENT = 0.5  # the object must be found in at least this share of the frames
MIN_TRAVEL = 0.08  # fraction of the frame size the centroid must move to count as motion
SQUARE_FILL = (1.0 + np.pi / 4) / 2  # fill ratio between a circle's and a square's


@dataclass(frozen=True)
class Judgement:
    colour: str | None  # None: no object found
    shape: str | None
    direction: str  # a DIRECTIONS key or "none"
    background: str
    travel: float  # centroid displacement over the clip, fraction of the frame size
    object_fraction: float  # share of pixels (all frames) that belong to the object

    def matches(self, want: PromptSpec) -> dict[str, bool]:
        return {
            "colour": self.colour == want.colour,
            "direction": self.direction == want.direction,
            "background": self.background == want.background,
            "shape": self.shape == want.shape,
        }

    def to_json(self) -> dict:
        return asdict(self)


def _nearest(rgb: np.ndarray, table: dict[str, tuple[float, float, float]]) -> str:
    names = list(table)
    dists = [float(np.linalg.norm(rgb - np.asarray(table[n]))) for n in names]
    return names[int(np.argmin(dists))]


def to_unit_frames(frames: np.ndarray) -> np.ndarray:
    """(T, H, W, 3) uint8 in [0, 255] or float in [0, 1] -> float64 in [0, 1]."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames (T, H, W, 3), got {frames.shape}")
    if frames.dtype == np.uint8:
        return frames.astype(np.float64) / 255.0
    return np.clip(frames.astype(np.float64), 0.0, 1.0)


def judge(frames: np.ndarray) -> Judgement:
    """Judge a video given as (T, H, W, 3) frames (uint8, or float in [0, 1])."""
    x = to_unit_frames(frames)
    t, h, w, _ = x.shape
    border = np.concatenate([x[:, 0], x[:, -1], x[:, :, 0], x[:, :, -1]], axis=1).reshape(-1, 3)
    bg_rgb = np.median(border, axis=0)
    background = _nearest(bg_rgb, BACKGROUNDS)

    dist = np.linalg.norm(x - bg_rgb, axis=-1)  # (T, H, W)
    mask = largest_blobs(dist > OBJECT_DIST)
    counts = mask.reshape(t, -1).sum(axis=1)
    present = counts >= MIN_AREA * h * w
    mask &= present[:, None, None]
    if present.mean() < MIN_PRESENT:
        return Judgement(None, None, "none", background, 0.0, 0.0)

    # Colour from the core: the farther half of the object's pixels from the background.
    obj = x[mask]
    core = obj[dist[mask] >= np.median(dist[mask])]
    colour = _nearest(np.median(core, axis=0), COLOURS)

    ys, xs = np.mgrid[0:h, 0:w]
    frames_idx = np.flatnonzero(present)
    cx = np.array([xs[mask[i]].mean() for i in frames_idx]) / w
    cy = np.array([ys[mask[i]].mean() for i in frames_idx]) / h
    if len(frames_idx) >= 2:
        tt = frames_idx / max(1, t - 1)
        span = tt[-1] - tt[0]
        vx, vy = np.polyfit(tt, cx, 1)[0] * span, np.polyfit(tt, cy, 1)[0] * span
    else:
        vx = vy = 0.0
    travel = float(np.hypot(vx, vy))
    if travel < MIN_TRAVEL:
        direction = "none"
    else:
        step = (int(np.sign(vx)), 0) if abs(vx) >= abs(vy) else (0, int(np.sign(vy)))
        direction = next(name for name, d in DIRECTIONS.items() if d == step)

    fills = []
    for i in frames_idx:
        rows, cols = np.flatnonzero(mask[i].any(axis=1)), np.flatnonzero(mask[i].any(axis=0))
        box = (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)
        fills.append(mask[i].sum() / box)
    shape = "square" if float(np.median(fills)) > SQUARE_FILL else "circle"
    return Judgement(colour, shape, direction, background, travel, float(mask.mean()))


def largest_blobs(mask: np.ndarray) -> np.ndarray:
    """Per frame of a (T, H, W) boolean mask, keep only its largest 4-connected component."""
    t, h, w = mask.shape
    big = t * h * w
    labels = np.where(mask, np.arange(big).reshape(t, h, w), big)
    for _ in range(4 * (h + w)):  # min-label propagation; blobs converge in about their diameter
        new = labels.copy()
        new[:, 1:] = np.minimum(new[:, 1:], labels[:, :-1])
        new[:, :-1] = np.minimum(new[:, :-1], labels[:, 1:])
        new[:, :, 1:] = np.minimum(new[:, :, 1:], labels[:, :, :-1])
        new[:, :, :-1] = np.minimum(new[:, :, :-1], labels[:, :, 1:])
        new = np.where(mask, new, big)
        if np.array_equal(new, labels):
            break
        labels = new
    out = np.zeros_like(mask)
    for i in range(t):
        ids, sizes = np.unique(labels[i][mask[i]], return_counts=True)
        if len(ids):
            out[i] = labels[i] == ids[np.argmax(sizes)]
    return out


def video_to_frames(video: np.ndarray | object) -> np.ndarray:
    """A (3, T, H, W) tensor/array in [-1, 1] (dataset / VAE output) -> (T, H, W, 3) in [0, 1]."""
    arr = np.asarray(video.detach().cpu() if hasattr(video, "detach") else video, dtype=np.float64)
    return np.clip((arr.transpose(1, 2, 3, 0) + 1.0) / 2.0, 0.0, 1.0)
