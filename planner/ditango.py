"""DiTango planner: which remote attention states to compute fresh and which to reuse.

Follows the authors' HPDC'26 code (ALGORITHMS.md 2.3), steps counted upward from 0:
warm-up and cool-down steps are exact; the first step after warm-up is an anchor (all
computed, every unit cached, importance refreshed); the step after an anchor reuses
every remote unit; from then on each step's plan is decided from the previous step's
accumulated state error (ASE): COMPUTE where ASE >= epsilon, epsilon being the
cache_ratio quantile of the ASE measured on the first selective step of the anchor window.
Options from the design notes (2.2), off by default: tau_max, anchor_interval, alpha.

Shape legend: B batch, S tokens, H heads, D head dim, L layers, U remote units (ring
offsets 1..U, a unit possibly being k composed groups).

Every input here is already all-reduced by the runtime, so the planner is a deterministic
function of replicated values and produces the same plan on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.errors import ConfigError
from planner.plan import PlanLog, StepPlan

__all__ = [
    "DiTangoPlanner",
    "PlanLog",
    "PlannerConfig",
    "StepPlan",
    "alpha_factors",
    "ase",
    "compressed_state",
    "drift",
    "importance_weights",
    "relative_drift",
]

TEMPERATURE_MIN = 1e-6  # authors' clamp on the softmax temperature (std of the lse norms)
NORM_MIN = 1e-12  # a zero local output norm would make alpha infinite


@dataclass(frozen=True)
class PlannerConfig:
    cache_ratio: float = 0.5  # target fraction of remote (layer, unit) cells reused on selective steps; 0 = exact
    warmup: int = 5  # first `warmup` steps exact
    cooldown: int = 5  # last `cooldown` steps exact
    gate_factor: float = 0.6  # anchor when mean relative local drift >= gate_factor * cache_ratio (2.3)
    tau_max: int | None = None  # recompute a cell whose cache would be >= tau_max steps old (2.2)
    anchor_interval: int | None = None  # force an anchor when step - last anchor >= interval (2.2)
    use_alpha: bool = False  # alpha factor (remote/local output norm ratio) in the drift estimate (2.2)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, legal: str) -> ConfigError:
            return ConfigError(f"planner {name}={value!r} is out of range; legal: {legal}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (isinstance(self.cache_ratio, (int, float)) and 0.0 <= self.cache_ratio < 1.0):
            raise bad("cache_ratio", self.cache_ratio, "0 <= cache_ratio < 1 (0 = exact attention)")
        if not (is_int(self.warmup) and self.warmup >= 0):
            raise bad("warmup", self.warmup, "an integer >= 0")
        if not (is_int(self.cooldown) and self.cooldown >= 0):
            raise bad("cooldown", self.cooldown, "an integer >= 0")
        if not (isinstance(self.gate_factor, (int, float)) and self.gate_factor > 0):
            raise bad("gate_factor", self.gate_factor, "a number > 0 (authors: 0.6)")
        if self.tau_max is not None and not (is_int(self.tau_max) and self.tau_max >= 1):
            raise bad("tau_max", self.tau_max, "an integer >= 1, or None to disable (design notes: 8)")
        if self.anchor_interval is not None and not (is_int(self.anchor_interval) and self.anchor_interval >= 1):
            raise bad("anchor_interval", self.anchor_interval, "an integer >= 1, or None to disable (design notes: 5)")


@dataclass(frozen=True)
class DiTangoOptions:
    """User intent for --parallel ditango beyond the planner: cache precision and memory cap."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    cache_dtype: str | None = None  # float32 | bfloat16 (the `out` part; lse stays float32); None: by device
    cache_limit_bytes: int | None = None  # None: automatic on CUDA (free memory), none on CPU

    def __post_init__(self) -> None:
        if self.cache_dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"--cache-dtype must be float32 or bfloat16, got {self.cache_dtype!r}")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes <= 0:
            raise ConfigError(f"--cache-memory-limit must be > 0, got {self.cache_limit_bytes}")


def importance_weights(lse_norms: torch.Tensor) -> torch.Tensor:
    """Importance of each partition at an anchor (2.3).

    lse_norms: float [..., U+1], s = ||lse||_2 over [units..., local] (last entry = local).
    Returns float32 softmax((s - max s) / T) over the last dim, T = population std of s
    clamped >= 1e-6 (the std temperature keeps large raw norms from giving one-hot weights).
    """
    s = lse_norms.float()
    temperature = s.std(dim=-1, unbiased=False, keepdim=True).clamp_min(TEMPERATURE_MIN)
    return torch.softmax((s - s.amax(dim=-1, keepdim=True)) / temperature, dim=-1)


def compressed_state(out_BSHD: torch.Tensor) -> torch.Tensor:
    """C = mean over the head dim of an attention output: float32 [B, S, H]."""
    return out_BSHD.float().mean(dim=-1)


def drift(c_now: torch.Tensor, c_ref: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of c_now - c_ref as a 0-d float32 tensor."""
    assert c_now.shape == c_ref.shape, (c_now.shape, c_ref.shape)
    return torch.linalg.vector_norm(c_now.float() - c_ref.float())


def alpha_factors(out_norms_units: torch.Tensor, out_norm_local: torch.Tensor) -> torch.Tensor:
    """alpha_u = ||AS_anchor(u)|| / ||AS_anchor(local)||, float32 [U] (2.2).

    Scales the local drift into a per-unit drift estimate. The local norm is clamped at
    1e-12 so a degenerate all-zero local output gives large, finite factors.
    """
    return out_norms_units.float() / out_norm_local.float().clamp_min(NORM_MIN)


def ase(weights_U: torch.Tensor, drift_U: torch.Tensor, alpha_U: torch.Tensor | None = None) -> torch.Tensor:
    """Accumulated state error per unit: w_u * drift_u, times alpha_u when given. float32 [U]."""
    assert weights_U.shape == drift_U.shape, (weights_U.shape, drift_U.shape)
    out = weights_U.float() * drift_U.float()
    if alpha_U is not None:
        assert alpha_U.shape == out.shape, (alpha_U.shape, out.shape)
        out = out * alpha_U.float()
    return out


def relative_drift(c_now: torch.Tensor, c_anchor: torch.Tensor) -> float:
    """||c_now - c_anchor|| / ||c_anchor|| (0 if ||c_anchor|| == 0): one layer's anchor-gate term."""
    ref = float(torch.linalg.vector_norm(c_anchor.float()))
    if ref == 0.0:
        return 0.0
    return float(drift(c_now, c_anchor)) / ref


class DiTangoPlanner:
    """Step-by-step plans for one run. Protocol, steps in order 0, 1, ...:

        p = planner.plan(step)            # before the step
        ...run the step...
        if p.kind == "selective":
            planner.observe(step, ase_LU, gate)   # all-reduced inputs, after the step

    A missing observe() is a runtime bug and raises AssertionError at the next plan().

    `switches`: steps where another model takes over (Wan2.2's second expert). The cached
    states and anchor statistics belong to the model that made them, so such a step is an
    anchor (all computed, everything refreshed) unless it is exact anyway.
    """

    def __init__(self, cfg: PlannerConfig, steps: int, layers: int, units: int, switches: tuple[int, ...] = ()):
        if steps < 1 or layers < 1 or units < 0:
            raise ConfigError(
                f"planner sizes steps={steps}, layers={layers}, units={units}; legal: steps >= 1, layers >= 1, units >= 0"
            )
        self.cfg = cfg
        self.steps = steps
        self.layers = layers
        self.units = units
        self.switches = tuple(sorted(int(s) for s in switches if 0 < int(s) < steps))
        self.reset()

    def reset(self) -> None:
        """Back to the state of a new run (same sizes and config)."""
        self._next_step = 0
        self._log: list[StepPlan] = []
        self._last_anchor: int | None = None
        self._epsilon: float | None = None
        self._awaiting: int | None = None  # selective step whose observe() is still due
        self._prepared: StepPlan | None = None  # plan of the next step, built by observe()
        self._last_computed_LU = torch.full((self.layers, self.units), -1, dtype=torch.long)

    @property
    def epsilon(self) -> float | None:
        return self._epsilon

    @property
    def last_anchor(self) -> int | None:
        return self._last_anchor

    def _is_exact(self, step: int) -> bool:
        if self.units == 0 or self.cfg.cache_ratio == 0:
            return True
        return step < self.cfg.warmup or step >= self.steps - self.cfg.cooldown

    def _all(self, value: bool) -> torch.Tensor:
        return torch.full((self.layers, self.units), value, dtype=torch.bool)

    def _decide(self, step: int, compute_LU: torch.Tensor, epsilon: float | None, gate_fired: bool) -> StepPlan:
        """Selective plan for `step`, or an anchor if the gate, tau_max or the interval say so."""
        assert self._last_anchor is not None
        if self.cfg.tau_max is not None:
            # age at `step` of each cell's cached state; the anchor counts as computed
            compute_LU = compute_LU | (step - self._last_computed_LU >= self.cfg.tau_max)
        interval = self.cfg.anchor_interval
        interval_due = interval is not None and step - self._last_anchor >= interval
        if gate_fired or interval_due or bool(compute_LU.all()):
            return StepPlan(step, "anchor", self._all(True), None)
        return StepPlan(step, "selective", compute_LU, epsilon)

    def plan(self, step: int) -> StepPlan:
        if step != self._next_step:
            raise AssertionError(f"plan({step}) out of order; expected step {self._next_step}")
        if self._awaiting is not None:
            raise AssertionError(f"observe() was not called after selective step {self._awaiting}")
        if step >= self.steps:
            raise AssertionError(f"plan({step}) beyond the run's {self.steps} steps")
        if self._is_exact(step):
            p = StepPlan(step, "exact", self._all(True), None)
        elif self._last_anchor is None or step in self.switches:
            p = StepPlan(step, "anchor", self._all(True), None)
        elif self._log[-1].kind == "anchor":
            # the step right after an anchor reuses every remote unit (2.3)
            p = self._decide(step, self._all(False), None, gate_fired=False)
        else:
            p = self._prepared
            if p is None or p.step != step:
                raise AssertionError(f"no plan prepared for step {step} (observe() missing?)")
        self._prepared = None
        if p.kind == "anchor":
            self._last_anchor = step
            self._epsilon = None
        if p.kind != "exact":
            self._last_computed_LU[p.compute_LU] = step
        if p.kind == "selective":
            self._awaiting = step
        self._log.append(p)
        self._next_step = step + 1
        return StepPlan(p.step, p.kind, p.compute_LU.clone(), p.epsilon)

    def observe(self, step: int, ase_LU: torch.Tensor, gate: float) -> None:
        """Feed the all-reduced ASE [L, U] and gate (mean over layers of relative_drift) of
        selective step `step`; prepares the plan of step + 1."""
        if self._awaiting != step:
            raise AssertionError(f"observe({step}) but the selective step awaiting observation is {self._awaiting}")
        assert tuple(ase_LU.shape) == (self.layers, self.units), (tuple(ase_LU.shape), self.layers, self.units)
        ase_LU = ase_LU.detach().to("cpu", torch.float32)
        assert bool(torch.isfinite(ase_LU).all()), "ASE must be finite"
        self._awaiting = None
        if self._epsilon is None:
            # first selective step of the anchor window: hold this threshold until the next anchor
            self._epsilon = float(torch.quantile(ase_LU.flatten(), self.cfg.cache_ratio))
        nxt = step + 1
        if nxt >= self.steps or self._is_exact(nxt):
            return  # cool-down (or end of run): exact, never an anchor
        gate_fired = float(gate) >= self.cfg.gate_factor * self.cfg.cache_ratio
        self._prepared = self._decide(nxt, ase_LU >= self._epsilon, self._epsilon, gate_fired)

    def log(self) -> PlanLog:
        """Everything planned so far (copies; safe to keep after reset())."""
        return PlanLog([StepPlan(p.step, p.kind, p.compute_LU.clone(), p.epsilon) for p in self._log])

    def __repr__(self) -> str:
        kinds = [p.kind for p in self._log]
        return (
            f"DiTangoPlanner(steps={self.steps}, layers={self.layers}, units={self.units}, "
            f"switches={self.switches}, next_step={self._next_step}, exact={kinds.count('exact')}, anchors={kinds.count('anchor')}, "
            f"selective={kinds.count('selective')}, last_anchor={self._last_anchor}, epsilon={self._epsilon})"
        )
