"""The step schedule every DiTango planner shares, and the planner's configuration.

Steps counted upward from 0. Warm-up and cool-down steps are exact; the first step after
warm-up is an anchor (all computed, every unit cached, statistics refreshed), and so is a
step where another expert takes over. Between anchors a planner (planner/hpdc.py,
planner/budget.py) decides each selective step's cells from the statistics the runtime
measured and all-reduced: every input is replicated, so every rank plans alike.

Shape legend: L layers, U units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from basics.errors import ConfigError
from planner.plan import PlanLog, StepPlan

PLANNERS = ("hpdc", "budget")
OWN_GROUP_MODES = ("decide", "fresh")
# "auto": reuse only where it saves more than its bookkeeping costs (planner/reuse.py); "always": as planned.
REUSE_MODES = ("auto", "always")


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
    reuse: str = "always"  # REUSE_MODES (a run's default is "auto": planner/ditango.py RUN_DEFAULTS)

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
        if self.reuse not in REUSE_MODES:
            raise bad("reuse", self.reuse, " or ".join(REUSE_MODES))


class StepPlanner:
    """Step-by-step plans for one run. Protocol, steps in order 0, 1, ...:

        p = planner.plan(step)            # before the step
        ...run the step...
        if planner.observes(p.kind):
            planner.observe(step, scores_LU, gate)   # all-reduced inputs, after the step

    A subclass decides the selective steps (`observe` prepares the next step's plan) and names
    the statistics the runtime measures for it (`Statistics`: planner/hpdc.py and
    planner/budget.py). A missing observe() is a runtime bug and raises AssertionError at the
    next plan().

    `switches`: steps where another model takes over (Wan2.2's second expert). The cached
    states and anchor statistics belong to the model that made them, so such a step is an
    anchor (all computed, everything refreshed) unless it is exact anyway.
    """

    name = ""
    observes_anchors = False  # whether an anchor's measurements plan the step after it
    keeps_exact_states = False  # whether exact steps refresh the cache (and the cells' ages)
    reuses_after_anchor = False  # whether the step after an anchor reuses every unit (no observation yet)
    Statistics: type = object  # what the runtime measures per layer for this planner

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
        self._selective_steps = 0  # planned so far
        self._anchor_due = False  # an anchor some of whose layers did not run: the next step is one

    @property
    def epsilon(self) -> float | None:
        return self._epsilon

    @property
    def last_anchor(self) -> int | None:
        return self._last_anchor

    def observes(self, kind: str) -> bool:
        """Whether the runtime must call observe() after a step of this kind."""
        return kind == "selective" or (kind == "anchor" and self.observes_anchors)

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
        elif self._log[-1].kind == "anchor" and self.reuses_after_anchor:
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
        if p.kind != "exact" or self.keeps_exact_states:
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
        """Feed the all-reduced scores [L, U] and gate of step `step`; prepares the plan of step + 1."""
        if self._awaiting != step:
            raise AssertionError(f"observe({step}) but the step awaiting observation is {self._awaiting}")
        assert tuple(scores_LU.shape) == (self.layers, self.units), (tuple(scores_LU.shape), self.layers, self.units)
        scores_LU = scores_LU.detach().to("cpu", torch.float32)
        assert bool(torch.isfinite(scores_LU).all()), "planner scores must be finite"
        self._awaiting = None
        self._prepare(step + 1, scores_LU, gate)

    def _prepare(self, step: int, scores_LU: torch.Tensor, gate: float) -> None:
        raise NotImplementedError

    def log(self) -> PlanLog:
        """Everything planned so far (copies; safe to keep after reset())."""
        return PlanLog([StepPlan(p.step, p.kind, p.compute_LU.clone(), p.epsilon) for p in self._log])

    def __repr__(self) -> str:
        kinds = [p.kind for p in self._log]
        return (
            f"{type(self).__name__}(steps={self.steps}, layers={self.layers}, units={self.units}, "
            f"switches={self.switches}, next_step={self._next_step}, exact={kinds.count('exact')}, anchors={kinds.count('anchor')}, "
            f"selective={kinds.count('selective')}, last_anchor={self._last_anchor}, epsilon={self._epsilon})"
        )


class StepStatistics:
    """What the runtime measures per layer for a planner, on the compute device: per branch,
    layer and unit a score (`ase_NLU`) and per branch and layer a gate term (`gate_NL`), reset
    every step; `scores` is the one vector a step all-reduces. Subclasses keep the states
    their measurements need (planner/hpdc.py, planner/budget.py).

    Shape legend: N CFG branches on this rank, L layers, U units, B batch, S local tokens, H heads."""

    reference_states = False  # whether it keeps compressed states per cached unit (sized with the cache)

    def __init__(
        self,
        cfg: PlannerConfig,
        branches: int,
        layers: int,
        units: int,
        switches: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.cfg, self.branches, self.layers, self.units = cfg, branches, layers, units
        self.switches, self.device = switches, device
        self.begin_step(None)

    def begin_step(self, plan: StepPlan | None) -> None:
        self.ase_NLU = torch.zeros(self.branches, self.layers, self.units, device=self.device)
        self.gate_NL = torch.zeros(self.branches, self.layers, device=self.device)

    def scores(self, ran_L: torch.Tensor) -> torch.Tensor:
        """[L * U + 1]: the scores averaged over branches, then the gate (mean over the layers that ran)."""
        ran = ran_L.to(self.gate_NL.device)
        gate = self.gate_NL[:, ran].mean() if bool(ran_L.any()) else self.gate_NL.sum()
        return torch.cat([self.ase_NLU.mean(0).flatten(), gate.reshape(1)])

    def end_step(self, step: int, plan: StepPlan, as_planned: bool) -> None:
        """After the step, with its plan as it ran (`as_planned`: every layer ran, so the plan is
        the one `begin_step` had)."""

    def nbytes(self) -> int:
        return 0
