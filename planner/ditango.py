"""DiTango planner: which attention states to compute fresh and which to reuse.

Two planners share one step schedule (planner/schedule.py: warm-up and cool-down exact,
anchors after warm-up and at expert switches) and differ in how they choose the cells of a
selective step, each with the statistics the runtime measures for it:

- "hpdc" (default, planner/hpdc.py) follows the authors' HPDC'26 code (docs/ALGORITHMS.md 2.3):
  a threshold on the accumulated state error, an anchor gate on the local drift;
- "budget" (planner/budget.py): a fixed per-step budget of the cells with the largest
  predicted error (measured error rate x age).

Options from the design notes (2.2), off by default: tau_max, anchor_interval, alpha, and
anchor_when_all (a step whose every cell would be computed becomes an anchor).

Decision units (`unit_offsets`): with own_group "decide" (the authors') only the rank's
own KV chunk is always fresh, and the other members of its group form unit 0; "fresh"
computes the whole own group every step. The remote groups at ring offsets 1..G-1 follow,
possibly composed k at a time.

Every input of a planner is already all-reduced by the runtime, so the planner is a
deterministic function of replicated values and produces the same plan on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from basics.errors import ConfigError
from planner.budget import BudgetPlanner, budget_scores, softmax_mass
from planner.hpdc import HpdcPlanner, alpha_factors, ase, compressed_state, drift, importance_weights, relative_drift
from planner.plan import PlanLog, StepPlan
from planner.schedule import OWN_GROUP_MODES, PLANNERS, REUSE_MODES, PlannerConfig, StepPlanner

__all__ = [
    "OWN_GROUP_MODES",
    "PLANNERS",
    "PLANNER_CLASSES",
    "REUSE_MODES",
    "RUN_DEFAULTS",
    "DiTangoOptions",
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

PLANNER_CLASSES: dict[str, type[StepPlanner]] = {"hpdc": HpdcPlanner, "budget": BudgetPlanner}
assert set(PLANNER_CLASSES) == set(PLANNERS)

# What a run (`generate`, `simulate`, a recorded plan) uses where an option is not given: the
# authors' test script's settings, and reuse only where it pays. PlannerConfig's own defaults are
# the library's.
RUN_DEFAULTS = PlannerConfig(cache_ratio=0.4, reuse="auto")
# The budget planner's cool-down where none is given: measured, its cool-down bought 0.3 dB for
# 0.07 x ring's bytes.
BUDGET_COOLDOWN = 0


def run_planner_config(**given) -> PlannerConfig:
    """The planner of a run: `given` (None values: not given) over RUN_DEFAULTS."""
    given = {k: v for k, v in given.items() if v is not None}
    defaults = RUN_DEFAULTS
    if given.get("planner") == "budget":
        defaults = replace(defaults, cooldown=BUDGET_COOLDOWN)
    return replace(defaults, **given)


def DiTangoPlanner(  # named as the class it builds
    cfg: PlannerConfig, steps: int, layers: int, units: int, switches: tuple[int, ...] = ()
) -> StepPlanner:
    """The planner `cfg.planner` names, for a run of `steps` steps (planner/schedule.py's protocol)."""
    return PLANNER_CLASSES[cfg.planner](cfg, steps, layers, units, switches)


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
