"""Procedural caption/video pairs for the built-in model: one shape moving over a plain background.

A video is a filled, anti-aliased circle or square of one colour that moves in a straight
line (left, right, up or down) at constant speed over a black or gray background, and
stays fully inside the frame. Its caption is built from the same words:
"a red circle moving left on a black background". Everything is a pure function of a
seed, so a dataset index always yields the same pair.

Videos are float tensors (3, T, H, W) in [-1, 1], the range Wan's VAE decodes to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# RGB in [0, 1]. Hues and brightness far apart so the decoded colour is unambiguous.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.80, 0.20),
    "blue": (0.15, 0.30, 1.00),
    "yellow": (0.95, 0.90, 0.10),
    "white": (1.00, 1.00, 1.00),
}
BACKGROUNDS: dict[str, tuple[float, float, float]] = {
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
}
SHAPES: tuple[str, ...] = ("circle", "square")
# Unit motion per direction in image coordinates (x to the right, y downwards).
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

FRAMES, HEIGHT, WIDTH = 17, 64, 64
RADIUS = (8.0, 11.0)  # circle radius / half the square's side, in pixels at 64x64
TRAVEL = (0.40, 0.55)  # distance covered over the clip, as a fraction of the frame size


@dataclass(frozen=True)
class VideoSpec:
    """One clip: what moves where. Sizes are fractions of the frame, so any resolution works."""

    colour: str
    shape: str
    direction: str
    background: str
    radius: float  # fraction of the frame size
    start: tuple[float, float]  # centre (x, y) at the first frame, fractions of width/height
    travel: float  # fraction of the frame size covered from first to last frame

    def __post_init__(self) -> None:
        for value, table, what in (
            (self.colour, COLOURS, "colour"),
            (self.shape, SHAPES, "shape"),
            (self.direction, DIRECTIONS, "direction"),
            (self.background, BACKGROUNDS, "background"),
        ):
            if value not in table:
                raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(table)}")

    @property
    def caption(self) -> str:
        return caption(self.colour, self.shape, self.direction, self.background)

    def centre(self, t: float) -> tuple[float, float]:
        """Object centre at clip time t in [0, 1], as fractions of width/height."""
        dx, dy = DIRECTIONS[self.direction]
        return self.start[0] + dx * self.travel * t, self.start[1] + dy * self.travel * t

    def render(self, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> torch.Tensor:
        """The clip as a float32 tensor (3, frames, height, width) in [-1, 1]."""
        size = min(height, width)
        ys = torch.arange(height, dtype=torch.float64).view(1, height, 1) + 0.5
        xs = torch.arange(width, dtype=torch.float64).view(1, 1, width) + 0.5
        t = torch.linspace(0.0, 1.0, frames, dtype=torch.float64) if frames > 1 else torch.zeros(1)
        dx, dy = DIRECTIONS[self.direction]
        cx = (self.start[0] + dx * self.travel * t).view(-1, 1, 1) * width
        cy = (self.start[1] + dy * self.travel * t).view(-1, 1, 1) * height
        r = self.radius * size
        if self.shape == "circle":
            dist = torch.sqrt((xs - cx) ** 2 + (ys - cy) ** 2) - r
        else:
            dist = torch.maximum((xs - cx).abs(), (ys - cy).abs()) - r
        cover = (0.5 - dist).clamp(0.0, 1.0)  # one-pixel anti-aliased edge; (T, H, W)
        fg = torch.tensor(COLOURS[self.colour], dtype=torch.float64).view(3, 1, 1, 1)
        bg = torch.tensor(BACKGROUNDS[self.background], dtype=torch.float64).view(3, 1, 1, 1)
        rgb = bg + (fg - bg) * cover.unsqueeze(0)
        return (rgb * 2.0 - 1.0).float()


def caption(colour: str, shape: str, direction: str, background: str) -> str:
    return f"a {colour} {shape} moving {direction} on a {background} background"


def sample_spec(seed: int) -> VideoSpec:
    """A random clip, deterministic in `seed`: uniform over every word, geometry within bounds."""
    rng = np.random.default_rng(seed)
    colour = str(rng.choice(list(COLOURS)))
    shape = str(rng.choice(SHAPES))
    direction = str(rng.choice(list(DIRECTIONS)))
    background = str(rng.choice(list(BACKGROUNDS)))
    radius = float(rng.uniform(*RADIUS)) / HEIGHT
    travel = float(rng.uniform(*TRAVEL))
    dx, dy = DIRECTIONS[direction]
    margin = radius + 1.0 / HEIGHT
    # Along the motion axis the whole path stays inside; across it, anywhere inside.
    along = float(rng.uniform(margin, 1.0 - margin - travel))
    across = float(rng.uniform(margin, 1.0 - margin))
    if dx:
        x0 = along if dx > 0 else 1.0 - along
        start = (x0, across)
    else:
        y0 = along if dy > 0 else 1.0 - along
        start = (across, y0)
    return VideoSpec(colour, shape, direction, background, radius, start, travel)


def all_captions() -> list[str]:
    """Every caption the dataset can produce (the conditioning vocabulary of the model)."""
    return [caption(c, s, d, b) for c in COLOURS for s in SHAPES for d in DIRECTIONS for b in BACKGROUNDS]


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for; the adherence checker scores a video against it."""

    colour: str
    shape: str
    direction: str
    background: str

    @property
    def caption(self) -> str:
        return caption(self.colour, self.shape, self.direction, self.background)


def eval_prompts(n: int, seed: int = 0) -> list[PromptSpec]:
    """`n` prompts covering colours x directions x backgrounds evenly (40 combinations, shuffled once)."""
    rng = np.random.default_rng(seed)
    combos = [(c, d, b) for c in COLOURS for d in DIRECTIONS for b in BACKGROUNDS]
    order = rng.permutation(len(combos))
    out = []
    for i in range(n):
        c, d, b = combos[order[i % len(combos)]]
        out.append(PromptSpec(c, SHAPES[(i // len(combos) + i) % len(SHAPES)], d, b))
    return out
