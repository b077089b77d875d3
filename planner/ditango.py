"""DiTango planner: which attention states to compute fresh and which to reuse.

Two planners, steps counted upward from 0. Common to both: warm-up and cool-down steps are
exact; the first step after warm-up is an anchor (all computed, every unit cached,
statistics refreshed), and so is a step where another expert takes over.

- "hpdc" (default) follows the authors' HPDC'26 code (ALGORITHMS.md 2.3): the step after an
  anchor reuses every unit; from then on each step's plan is decided from the previous
  step's accumulated state error (ASE = anchor importance x local drift): COMPUTE where
  ASE >= epsilon, epsilon being the cache_ratio quantile of the ASE measured on the first
  selective step of the anchor window; the anchor gate (mean relative local drift since the
  anchor >= gate_factor x cache_ratio) makes the next step an anchor.
- "budget": every selective step computes (1 - cache_ratio) x cells cells (a fraction
  carried over to the next steps), those with the largest predicted error if reused one
  step more (`budget_scores`: the cell's measured error rate x the age its cache would
  have). Rates are measured whenever a cell is recomputed, on exact steps too, so the
  first selective step follows the warm-up directly (its states are the cache) and no
  statistic goes stale that an anchor would refresh: anchors come only from expert
  switches, tau_max, anchor_interval or anchor_when_all.

Options from the design notes (2.2), off by default: tau_max, anchor_interval, alpha, and
anchor_when_all (a step whose every cell would be computed becomes an anchor).

Decision units (`unit_offsets`): with own_group "decide" (the authors') only the rank's
own KV chunk is always fresh, and the other members of its group form unit 0; "fresh"
computes the whole own group every step. The remote groups at ring offsets 1..G-1 follow,
possibly composed k at a time.

Shape legend: B batch, S tokens, H heads, D head dim, L layers, U units.

Every input here is already all-reduced by the runtime, so the planner is a deterministic
function of replicated values and produces the same plan on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.errors import ConfigError
from planner.plan import PlanLog, StepPlan

__all__ = [
    "OWN_GROUP_MODES",
    "PLANNERS",
    "DiTangoPlanner",
    "PlanLog",
    "PlannerConfig",
    "StepPlan",
    "alpha_factors",
    "ase",
    "budget_scores",
    "compressed_state",
    "drift",
    "importance_weights",
    "relative_drift",
    "softmax_mass",
    "unit_offsets",
]

PLANNERS = ("hpdc", "budget")
OWN_GROUP_MODES = ("decide", "fresh")

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
    planner: str = "hpdc"  # PLANNERS: the authors' ASE threshold, or a per-step budget of the largest errors
    own_group: str = "decide"  # OWN_GROUP_MODES: the own group's other members a decision unit, or always fresh
    anchor_when_all: bool = False  # a step whose every cell would be computed becomes an anchor (design notes)
    # Budget planner: the quota of the first selective step, as a multiple of the mean quota,
    # falling linearly to 2 - front_load at the last one (1: flat). Early steps change the
    # video most; 1.6 measured +1 dB over flat at equal bytes on the built-in model.
    front_load: float = 1.6

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
        if self.planner not in PLANNERS:
            raise bad("planner", self.planner, " or ".join(PLANNERS))
        if not (isinstance(self.front_load, (int, float)) and 0.0 <= self.front_load <= 2.0):
            raise bad("front_load", self.front_load, "0 <= front_load <= 2 (1: the same quota on every selective step)")
        if self.own_group not in OWN_GROUP_MODES:
            raise bad("own_group", self.own_group, " or ".join(OWN_GROUP_MODES))


@dataclass(frozen=True)
class DiTangoOptions:
    """User intent for --parallel ditango beyond the planner: cache precision and memory cap."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    cache_dtype: str | None = None  # float32 | bfloat16 (the `out` part; lse stays float32); None: by device
    cache_limit_bytes: int | None = None  # None: automatic on CUDA (free memory), none on CPU
    target_psnr: float | None = None  # dB vs exact: the cache ratio is calibrated for it (runtime/calibrate.py)

    def __post_init__(self) -> None:
        if self.cache_dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"--cache-dtype must be float32 or bfloat16, got {self.cache_dtype!r}")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes <= 0:
            raise ConfigError(f"--cache-memory-limit must be > 0, got {self.cache_limit_bytes}")
        if self.target_psnr is not None and not (
            isinstance(self.target_psnr, (int, float)) and 0 < self.target_psnr < 100
        ):
            raise ConfigError(f"--target-psnr must be a PSNR in dB between 0 and 100, got {self.target_psnr!r}")


def unit_offsets(groups: int, group_size: int, own_group: str, compose: int = 1) -> list[tuple[int, ...]]:
    """The ring offsets each decision unit covers, unit 0 first: offset 0 stands for the
    other members of the rank's own group (a unit only with own_group "decide" and groups of
    more than one rank), then the remote groups 1..groups-1, `compose` adjacent ones a unit."""
    units: list[tuple[int, ...]] = [(0,)] if own_group == "decide" and group_size > 1 else []
    units += [tuple(range(d, min(groups, d + compose))) for d in range(1, groups, compose)]
    return units


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


def softmax_mass(lse_BSH: torch.Tensor, total_lse_BSH: torch.Tensor) -> torch.Tensor:
    """Mean over query rows (and heads) of a partition's share of the softmax, exp(lse - total
    lse): the weight its state has in the merged output (ALGORITHMS.md 1). 0-d float32."""
    return torch.exp(lse_BSH.float() - total_lse_BSH.float()).mean()


def budget_scores(rate_U: torch.Tensor, age_U: torch.Tensor) -> torch.Tensor:
    """The budget planner's predicted error of reusing each unit at the next step: its error
    rate (relative output error per step of staleness) times the age its cache would have
    then (at least 1: a cell refreshed just now still goes one step stale). float32 [U];
    relative errors, so cells of different layers compare."""
    return rate_U.float() * age_U.float()


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
        if planner.observes(p.kind):
            planner.observe(step, scores_LU, gate)   # all-reduced inputs, after the step

    `scores_LU`: the hpdc planner's ASE, or the budget planner's `budget_scores`; the hpdc
    planner observes selective steps, the budget planner anchors too (its plan for the step
    after an anchor comes from the anchor's measurements). A missing observe() is a runtime
    bug and raises AssertionError at the next plan().

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
        self._awaiting: int | None = None  # step whose observe() is still due
        self._prepared: StepPlan | None = None  # plan of the next step, built by observe()
        self._last_computed_LU = torch.full((self.layers, self.units), -1, dtype=torch.long)
        self._before_LU = self._last_computed_LU.clone()  # as it was before the last plan
        self._selective_steps = 0  # planned so far (the budget's carried fraction)
        self._anchor_due = False  # an anchor some of whose layers did not run: the next step is one

    @property
    def epsilon(self) -> float | None:
        return self._epsilon

    @property
    def last_anchor(self) -> int | None:
        return self._last_anchor

    def budget_cells(self, selective_index: int) -> int:
        """Cells the budget planner computes on its `selective_index`-th selective step. The mean
        quota is (1 - cache_ratio) x cells per selective step, front-loaded: the rate falls
        linearly from front_load x quota to (2 - front_load) x quota over the n = steps -
        warm-up - cool-down - 1 selective steps a run with one anchor has. Cumulative counts
        are rounded, so the first i steps compute round(Q(i)) cells, Q the rate's integral."""
        quota = (1.0 - self.cfg.cache_ratio) * self.layers * self.units
        n = max(1, self.steps - self.cfg.warmup - self.cfg.cooldown - 1)
        a = self.cfg.front_load

        def cumulative(i: int) -> float:
            x = min(i, n) / n
            return quota * (n * (a * x + (1 - a) * x * x) + max(0, i - n))

        return round(cumulative(selective_index + 1)) - round(cumulative(selective_index))

    def observes(self, kind: str) -> bool:
        """Whether the runtime must call observe() after a step of this kind: selective steps;
        for the budget planner anchors too (it plans the step after an anchor)."""
        return kind == "selective" or (kind == "anchor" and self.cfg.planner == "budget")

    def _is_exact(self, step: int) -> bool:
        if self.units == 0 or self.cfg.cache_ratio == 0:
            return True
        return step < self.cfg.warmup or step >= self.steps - self.cfg.cooldown

    def _all(self, value: bool) -> torch.Tensor:
        return torch.full((self.layers, self.units), value, dtype=torch.bool)

    def _decide(self, step: int, compute_LU: torch.Tensor, epsilon: float | None, gate_fired: bool) -> StepPlan:
        """Selective plan for `step`, or an anchor if the gate, the interval or (with
        anchor_when_all) a plan computing every cell say so; tau_max adds its stale cells."""
        assert self._last_anchor is not None
        if self.cfg.tau_max is not None:
            # age at `step` of each cell's cached state; the anchor counts as computed
            compute_LU = compute_LU | (step - self._last_computed_LU >= self.cfg.tau_max)
        interval = self.cfg.anchor_interval
        interval_due = interval is not None and step - self._last_anchor >= interval
        if gate_fired or interval_due or (self.cfg.anchor_when_all and bool(compute_LU.all())):
            return StepPlan(step, "anchor", self._all(True), None)
        return StepPlan(step, "selective", compute_LU, epsilon)

    def plan(self, step: int) -> StepPlan:
        if step != self._next_step:
            raise AssertionError(f"plan({step}) out of order; expected step {self._next_step}")
        if self._awaiting is not None:
            raise AssertionError(f"observe() was not called after step {self._awaiting}")
        if step >= self.steps:
            raise AssertionError(f"plan({step}) beyond the run's {self.steps} steps")
        if self._is_exact(step):
            p = StepPlan(step, "exact", self._all(True), None)
        elif self._last_anchor is None or step in self.switches or self._anchor_due:
            p = StepPlan(step, "anchor", self._all(True), None)
        elif self._log[-1].kind == "anchor" and self.cfg.planner == "hpdc":
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
            self._anchor_due = False
        self._before_LU = self._last_computed_LU.clone()
        if p.kind != "exact" or self.cfg.planner == "budget":  # the budget planner keeps exact steps' states
            self._last_computed_LU[p.compute_LU] = step
        if p.kind == "selective":
            self._selective_steps += 1
        if self.observes(p.kind):
            self._awaiting = step
        self._log.append(p)
        self._next_step = step + 1
        return StepPlan(p.step, p.kind, p.compute_LU.clone(), p.epsilon)

    def last_plan(self) -> StepPlan:
        """The plan of the step last planned, as the log holds it (after `not_run`)."""
        p = self._log[-1]
        return StepPlan(p.step, p.kind, p.compute_LU.clone(), p.epsilon)

    def not_run(self, step: int, missing_L: torch.Tensor) -> None:
        """Layers of the step just planned that did not run (a step cache skipped their blocks
        or their attention; agreed over the plan group): none of their cells was computed, so
        the log says so and their caches keep their age. An anchor missing layers did not
        measure them: the next step is an anchor again (on a skipped step it costs little)."""
        p = self._log[-1]
        assert p.step == step and tuple(missing_L.shape) == (self.layers,), (p.step, step, tuple(missing_L.shape))
        if not bool(missing_L.any()):
            return
        p.compute_LU[missing_L] = False
        self._last_computed_LU[missing_L] = self._before_LU[missing_L]
        if p.kind == "anchor":
            self._anchor_due = True

    def observe(self, step: int, scores_LU: torch.Tensor, gate: float) -> None:
        """Feed the all-reduced scores [L, U] (ASE, or budget scores) and gate (mean over
        layers of relative_drift; the budget planner ignores it) of step `step`; prepares the
        plan of step + 1."""
        if self._awaiting != step:
            raise AssertionError(f"observe({step}) but the step awaiting observation is {self._awaiting}")
        assert tuple(scores_LU.shape) == (self.layers, self.units), (tuple(scores_LU.shape), self.layers, self.units)
        scores_LU = scores_LU.detach().to("cpu", torch.float32)
        assert bool(torch.isfinite(scores_LU).all()), "planner scores must be finite"
        self._awaiting = None
        nxt = step + 1
        if self.cfg.planner == "budget":
            if nxt < self.steps and not self._is_exact(nxt):
                compute_LU, cut = self._largest(scores_LU)
                self._prepared = self._decide(nxt, compute_LU, cut, gate_fired=False)
            return
        if self._epsilon is None:
            # first selective step of the anchor window: hold this threshold until the next anchor
            self._epsilon = float(torch.quantile(scores_LU.flatten(), self.cfg.cache_ratio))
        if nxt >= self.steps or self._is_exact(nxt):
            return  # cool-down (or end of run): exact, never an anchor
        gate_fired = float(gate) >= self.cfg.gate_factor * self.cfg.cache_ratio
        self._prepared = self._decide(nxt, scores_LU >= self._epsilon, self._epsilon, gate_fired)

    def _largest(self, scores_LU: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """The budget's cells with the largest scores (ties: the lower layer, then the nearer
        unit, by a stable sort of replicated values) and the smallest score taken."""
        k = self.budget_cells(self._selective_steps)
        order = torch.argsort(scores_LU.flatten(), descending=True, stable=True)[:k]
        compute = torch.zeros(self.layers * self.units, dtype=torch.bool)
        compute[order] = True
        cut = float(scores_LU.flatten()[order[-1]]) if k else None
        return compute.reshape(self.layers, self.units), cut

    def log(self) -> PlanLog:
        """Everything planned so far (copies; safe to keep after reset())."""
        return PlanLog([StepPlan(p.step, p.kind, p.compute_LU.clone(), p.epsilon) for p in self._log])

    def __repr__(self) -> str:
        kinds = [p.kind for p in self._log]
        return (
            f"DiTangoPlanner({self.cfg.planner}, steps={self.steps}, layers={self.layers}, units={self.units}, "
            f"switches={self.switches}, next_step={self._next_step}, exact={kinds.count('exact')}, anchors={kinds.count('anchor')}, "
            f"selective={kinds.count('selective')}, last_anchor={self._last_anchor}, epsilon={self._epsilon})"
        )
