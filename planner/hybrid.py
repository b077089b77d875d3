"""Hybridiff's schedule (CVPR '26; docs/ALGORITHMS.md section 3): when to switch from
CFG-parallel to the two-segment pipeline and back.

Ascending step index i = 0, 1, ... (the paper's Algorithm 1 counts steps downward and
can never enter the pipeline stage as written). The monitor is the relative mean
absolute discrepancy of the two CFG predictions,
    M_i = mean|eps_c - eps_u| / mean|eps_u|,
which is U-shaped over a run. For i >= L the slope over the last L values is
    G_i = (M_{i-L+1} - M_i) / L,
and tau1 is the first i with 0 <= G_i < g_slope (M has stopped falling); if none has
been found at i = tau_cap - 1, tau1 = tau_cap. The pipeline stage covers steps
tau1 + 1 .. tau2 = tau1 + k; CFG-parallel runs before and after.

Defaults are the paper's SD3 setting (the closest to Wan: a flow-matching DiT) at 50
steps: window L = 15, tau_cap = 40, k = 5, and g_slope = 5e-4 (the released code's
value; the paper's text says 1e-4). For other step counts L, tau_cap and k scale with
steps / 50 and g_slope with 50 / steps (M then moves more per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from basics.errors import ConfigError

Stage = Literal["cfg-parallel", "pipeline-fill", "pipeline"]
REFERENCE_STEPS = 50
PAPER_DEFAULTS = {"k": 5, "window": 15, "slope": 5e-4, "tau_cap": 40}


FIRST_SEGMENT_TEXTS = ("cond", "uncond")  # the text segment A runs with: the conditional one first (default)


@dataclass(frozen=True)
class HybridConfig:
    """Hybridiff settings; a field left None takes the paper default scaled to the item's steps."""

    k: int | None = None  # pipeline steps; 0 = plain CFG-parallel
    window: int | None = None  # L
    slope: float | None = None  # g_slope
    tau_cap: int | None = None
    split: int | None = None  # first block of the second segment; None: half the blocks
    first_segment_text: Literal["cond", "uncond"] = FIRST_SEGMENT_TEXTS[0]

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 0:
            raise ConfigError(f"--hybrid-k must be >= 0, got {self.k}")
        if self.window is not None and self.window < 2:
            raise ConfigError(f"--hybrid-window must be >= 2, got {self.window}")
        if self.slope is not None and not self.slope > 0:
            raise ConfigError(f"--hybrid-slope must be > 0, got {self.slope}")
        if self.tau_cap is not None and self.tau_cap < 0:
            raise ConfigError(f"--hybrid-tau-cap must be >= 0, got {self.tau_cap}")
        if self.first_segment_text not in FIRST_SEGMENT_TEXTS:
            raise ConfigError(f"--hybrid-first-text must be cond or uncond, got {self.first_segment_text!r}")

    def split_for(self, layers: int) -> int:
        split = layers // 2 if self.split is None else self.split
        if not 1 <= split < layers:
            raise ConfigError(f"--hybrid-split must be in [1, {layers - 1}] for {layers} blocks, got {split}")
        return split

    def scaled(self) -> list[str]:
        """Names of the settings that take a (possibly scaled) default."""
        return [k for k in ("k", "window", "slope", "tau_cap") if getattr(self, k) is None]

    def resolved(self, steps: int) -> HybridConfig:
        """Every None filled with the paper default scaled to `steps`."""
        defaults = scaled_defaults(steps)
        filled = {k: defaults[k] if getattr(self, k) is None else getattr(self, k) for k in defaults}
        return HybridConfig(split=self.split, first_segment_text=self.first_segment_text, **filled)


def scaled_defaults(steps: int) -> dict:
    """The paper's 50-step settings scaled to `steps` (see the module docstring)."""
    f = steps / REFERENCE_STEPS
    return {
        "k": max(1, round(PAPER_DEFAULTS["k"] * f)),
        "window": max(2, round(PAPER_DEFAULTS["window"] * f)),
        "slope": PAPER_DEFAULTS["slope"] / f,
        "tau_cap": max(1, round(PAPER_DEFAULTS["tau_cap"] * f)),
    }


def detect_tau1(m: list[float], window: int, slope: float, tau_cap: int) -> int | None:
    """tau1 from the monitor values M_0..M_{n-1} seen so far, or None if not decided yet."""
    for i in range(len(m)):
        if i >= window:
            g = (m[i - window + 1] - m[i]) / window
            if 0 <= g < slope:
                return i
        if i >= tau_cap - 1:
            return tau_cap
    return None


@dataclass
class HybridSchedule:
    """Online schedule for one run; every rank feeds the same M values, so it agrees."""

    cfg: HybridConfig
    steps: int
    rel_mae: list[float | None] = field(default_factory=list)  # None on pipeline steps (one prediction)
    stages: list[Stage] = field(default_factory=list)
    tau1: int | None = None

    @property
    def tau2(self) -> int | None:
        return None if self.tau1 is None else min(self.tau1 + self.cfg.k, self.steps - 1)

    def __post_init__(self) -> None:
        self.cfg = self.cfg.resolved(self.steps)

    def stage(self, step: int) -> Stage:
        if self.cfg.k == 0 or self.tau1 is None or step <= self.tau1 or step > self.tau2:
            return "cfg-parallel"
        return "pipeline-fill" if step == self.tau1 + 1 else "pipeline"

    def begin(self, step: int) -> Stage:
        assert step == len(self.stages), "steps must be run in order"
        stage = self.stage(step)
        self.stages.append(stage)
        return stage

    def observe(self, step: int, m: float | None) -> None:
        """Record M_step (None on pipeline steps); decides tau1 while it is undecided."""
        self.rel_mae.append(m)
        if self.tau1 is None and m is not None:
            seen = [x for x in self.rel_mae if x is not None]
            self.tau1 = detect_tau1(seen, self.cfg.window, self.cfg.slope, self.cfg.tau_cap)

    def to_json(self) -> dict:
        return {
            "tau1": self.tau1,
            "tau2": self.tau2,
            "k": self.cfg.k,
            "window": self.cfg.window,
            "slope": self.cfg.slope,
            "tau_cap": self.cfg.tau_cap,
            "first_segment_text": self.cfg.first_segment_text,
            "rel_mae": self.rel_mae,
            "stages": self.stages,
        }
