"""DiTango plan shapes: what a DiTango run's plan looks like apart from its length and layout,
recorded from real runs and replayed by the cost model (planner/cost_model.py).

A plan shape is the share of a run's non-exact steps that were anchors and, per decision
unit keyed by ring distance (the own group's other members, then remote offsets 1, 2, ...),
the fraction of its cells (layers) computed on selective steps. The planners decide from
attention states measured in the run (the hpdc planner from each step's accumulated state
error), which a simulation does not have, so `ditango simulate` prices DiTango from a plan
its planners made: the shapes recorded by benchmarks/plan_shapes.py (planner/plan_shapes.json),
or one run's plan file (`--plan report.json`), replayed on the layout and step count priced.
The replay rules (exact, anchor and selective steps; offsets mapped by relative ring
distance; the budget planner's own quota) are `ASSUMPTIONS["ditango_synthetic"]` and
`ASSUMPTIONS["plan_mapping"]` in planner/cost_model.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import TEXT_LIMIT, read_json_file
from planner.ditango import OWN_GROUP_MODES, PLANNERS, RUN_DEFAULTS, DiTangoPlanner, PlannerConfig
from planner.layout import ParallelLayout
from planner.traffic import ditango_units

PLAN_SHAPES_FILE = Path(__file__).with_name("plan_shapes.json")  # written by benchmarks/plan_shapes.py
SHAPES_FORMAT = "ditango-plan-shapes/1"


@dataclass(frozen=True)
class PlanShape:
    """What a DiTango run's plan looks like apart from its length and layout: the share of
    its non-exact steps that were anchors, and per decision unit the fraction of its cells
    (layers) computed on selective steps, keyed by ring distance."""

    planner: str
    cache_ratio: float
    anchor_share: float  # anchors / (anchor + selective steps)
    own: float | None  # offset 0, the own group's other members (None: the run had no such unit)
    offsets: tuple[float, ...]  # remote offsets 1, 2, ... of the run, nearest first
    warmup: int = 5  # the run's exact steps at the start and at the end
    cooldown: int = 5

    @property
    def selective_fraction(self) -> float:
        """Computed share of the run's units on selective steps (composed units count per offset)."""
        units = ([] if self.own is None else [self.own]) + list(self.offsets)
        return sum(units) / len(units) if units else 1.0


def _fraction(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1


def plan_shape(plan_log: dict, planner: str, cache_ratio: float) -> PlanShape:
    """The shape of a plan file (`<id>.plan.json`). Units are read from its `unit_offsets`;
    a file without them is taken to hold the remote offsets 1, 2, ... in order."""
    steps = plan_log["steps"]
    kinds = [s["kind"] for s in steps]
    non_exact = kinds.count("anchor") + kinds.count("selective")
    rows = [row for s in steps if s["kind"] == "selective" for row in s["compute"]]
    width = len(steps[0]["compute"][0]) if steps and steps[0]["compute"] else 0
    units = plan_log.get("unit_offsets") or [[d] for d in range(1, width + 1)]
    per_unit = [sum(row[u] == "1" for row in rows) / len(rows) if rows else 1.0 for u in range(len(units))]
    own = next((f for f, offs in zip(per_unit, units, strict=True) if list(offs) == [0]), None)
    remote = sorted((d, f) for f, offs in zip(per_unit, units, strict=True) for d in offs if d > 0)
    share = kinds.count("anchor") / non_exact if non_exact else 0.0
    warmup = next((i for i, k in enumerate(kinds) if k != "exact"), len(kinds))
    cooldown = next((i for i, k in enumerate(reversed(kinds[warmup:])) if k != "exact"), 0)
    return PlanShape(planner, float(cache_ratio), share, own, tuple(f for _, f in remote), warmup, cooldown)


def map_offsets(fractions: tuple[float, ...] | list[float], groups: int) -> list[float]:
    """Per remote offset 1..groups-1 of a layout, from a run's per-offset `fractions` by
    relative ring distance: offset d takes the run's offset round((d-1) (n-1) / (groups-2)) + 1
    of its n, so nearest maps to nearest and farthest to farthest."""
    n = len(fractions)
    if n == 0:
        return [1.0] * max(0, groups - 1)
    span = max(1, groups - 2)
    return [fractions[round((d - 1) * (n - 1) / span)] for d in range(1, groups)]


def _on_units(shape: PlanShape, units: list[tuple[int, ...]], groups: int) -> list[float]:
    """A shape's selective fractions on a layout's decision units (compose factor 1). A run
    without an own-group unit lends the layout's partner unit its nearest remote offset."""
    remote = map_offsets(shape.offsets, groups)
    nearest = shape.offsets[0] if shape.offsets else 1.0
    own = nearest if shape.own is None else shape.own
    return [own if offs == (0,) else remote[offs[0] - 1] for offs in units]


def _scale_to_mean(fractions: list[float], mean: float) -> list[float]:
    """`fractions` scaled so that their mean is `mean`, none above 1: what a capped one
    cannot take goes to the others in proportion (all equal when every one is 0)."""
    f, n = list(fractions), len(fractions)
    if n == 0 or mean >= 1.0:
        return [1.0] * n
    capped: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in capped]
        room, mass = mean * n - len(capped), sum(f[i] for i in free)
        for i in free:
            f[i] = room / len(free) if mass == 0 else f[i] * room / mass
        over = [i for i in free if f[i] > 1.0]
        if not over:
            return f
        capped.update(over)
        for i in over:
            f[i] = 1.0


@dataclass(frozen=True)
class PlanReplay:
    """A plan shape replayed on one layout and step count: how many steps of each kind, and
    per decision unit (`traffic.ditango_units`) the computed fraction on selective steps."""

    exact: int
    anchors: int
    selective: int
    selective_U: tuple[float, ...]  # per unit, on selective steps
    planner: str = "hpdc"
    notes: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        return self.exact + self.anchors + self.selective

    @property
    def unit_fractions(self) -> list[float]:
        """Per unit over all steps: exact and anchor steps compute everything."""
        full = self.exact + self.anchors
        return [(full + self.selective * f) / self.steps for f in self.selective_U]

    @property
    def kinds(self) -> list[str]:
        return ["exact"] * self.exact + ["anchor"] * self.anchors + ["selective"] * self.selective

    def summary(self) -> dict:
        sel = self.selective_U
        every = self.unit_fractions
        return {
            "computed_fraction_all_steps": round(sum(every) / len(every), 4) if every else 1.0,
            "computed_fraction_selective": round(sum(sel) / len(sel), 4) if sel and self.selective else None,
            "steps": {"exact": self.exact, "anchor": self.anchors, "selective": self.selective},
        }


def replay(
    shapes: list[PlanShape],
    layout: ParallelLayout,
    layers: int,
    steps: int,
    cache_ratio: float,
    own_group: str = "decide",
    warmup: int = 5,
    cooldown: int = 5,
) -> PlanReplay:
    """`shapes` (one planner, any cache ratios) replayed at `cache_ratio` on `layout` for `steps`
    steps: exact = min(steps, warmup + cooldown), anchors = max(1, round(share x non-exact))
    (none if the recording had none), the rest selective with each unit's fraction as
    `_interpolated` gives it. The budget planner's selective total is exact by construction
    (`_budget_fraction`): only its spread over the units comes from the recording."""
    units = ditango_units(layout, own_group)
    planner = shapes[0].planner
    if not units or cache_ratio == 0:  # nothing to decide, or exact attention: every step exact
        return PlanReplay(steps, 0, 0, tuple(1.0 for _ in units), planner)
    fractions, share, notes = _interpolated(shapes, cache_ratio, units, layout.groups)
    exact = min(steps, warmup + cooldown)
    anchors = min(steps - exact, max(1, round(share * (steps - exact)))) if steps > exact and share > 0 else 0
    selective = steps - exact - anchors
    if planner == "budget" and selective:
        budget = PlannerConfig(cache_ratio=cache_ratio, warmup=warmup, cooldown=cooldown, planner="budget")
        fractions = _scale_to_mean(fractions, _budget_fraction(budget, steps, layers, len(units), selective))
    return PlanReplay(exact, anchors, selective, tuple(fractions), planner, tuple(notes))


def _budget_fraction(cfg: PlannerConfig, steps: int, layers: int, units: int, selective: int) -> float:
    """Share of cells the budget planner computes over `selective` selective steps, by its own
    quota (`DiTangoPlanner.budget_cells`: (1 - cache_ratio) x cells a step on average, as it
    spreads and rounds them; a step cannot take more than all its cells), so the replay
    follows the planner whatever its schedule."""
    planner, cells = DiTangoPlanner(cfg, steps, layers, units), layers * units
    return sum(min(cells, planner.budget_cells(i)) for i in range(selective)) / (selective * cells)


def _interpolated(
    shapes: list[PlanShape], cache_ratio: float, units: list[tuple[int, ...]], groups: int
) -> tuple[list[float], float, list[str]]:
    """Selective fraction per unit and anchor share at `cache_ratio`: linear between the two
    recorded ratios around it, the nearest recorded one outside them (with a note)."""
    ordered = sorted(shapes, key=lambda s: s.cache_ratio)
    lo, hi, notes = ordered[0], ordered[-1], []
    r = min(max(cache_ratio, lo.cache_ratio), hi.cache_ratio)
    if r != cache_ratio:
        notes.append(
            f"{lo.planner} plan shape recorded for cache ratios {lo.cache_ratio:g}..{hi.cache_ratio:g}; "
            f"{cache_ratio:g} priced with the shape at {r:g}"
        )
    a = max((s for s in ordered if s.cache_ratio <= r), key=lambda s: s.cache_ratio)
    b = min((s for s in ordered if s.cache_ratio >= r), key=lambda s: s.cache_ratio)
    w = 0.0 if b.cache_ratio == a.cache_ratio else (r - a.cache_ratio) / (b.cache_ratio - a.cache_ratio)
    if units[0] == (0,) and (a.own is None or b.own is None):
        notes.append(
            f"{lo.planner} plan shape recorded without an own-group unit: unit 0 (the own group's other "
            "members) takes the nearest remote offset's fraction"
        )
    fa, fb = _on_units(a, units, groups), _on_units(b, units, groups)
    fractions = [(1 - w) * x + w * y for x, y in zip(fa, fb, strict=True)]
    return fractions, (1 - w) * a.anchor_share + w * b.anchor_share, notes


def load_plan_shapes(path: Path = PLAN_SHAPES_FILE) -> dict[str, list[PlanShape]]:
    """The recorded shapes per planner (benchmarks/plan_shapes.py writes the file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data.get("format") == SHAPES_FORMAT, data.get("format")
        return {
            planner: [
                PlanShape(
                    planner,
                    s["cache_ratio"],
                    s["anchor_share"],
                    s["own"],
                    tuple(s["offsets"]),
                    s["warmup"],
                    s["cooldown"],
                )
                for s in runs
            ]
            for planner, runs in data["shapes"].items()
        }
    except (OSError, json.JSONDecodeError, AssertionError, KeyError, TypeError) as exc:
        raise ConfigError(f"plan shapes {path}: cannot read ({exc!r}); rerun benchmarks/plan_shapes.py") from None


@dataclass(frozen=True)
class PlanSource:
    """Where `simulate` takes DiTango's plan from: recorded `shapes` at `cache_ratio`, or a
    flat all-steps `fallback` fraction (a report without a plan file)."""

    description: str
    shapes: tuple[PlanShape, ...] = ()
    cache_ratio: float = RUN_DEFAULTS.cache_ratio
    own_group: str = RUN_DEFAULTS.own_group
    warmup: int = RUN_DEFAULTS.warmup
    cooldown: int = RUN_DEFAULTS.cooldown
    fallback: float | None = None

    def replay(self, layout: ParallelLayout, layers: int, steps: int) -> PlanReplay | float:
        if self.fallback is not None:
            return self.fallback
        return replay(
            list(self.shapes), layout, layers, steps, self.cache_ratio, self.own_group, self.warmup, self.cooldown
        )


def recorded_source(
    planner: str,
    cache_ratio: float,
    own_group: str = "decide",
    warmup: int | None = None,
    cooldown: int | None = None,
    path: Path = PLAN_SHAPES_FILE,
) -> PlanSource:
    """The shipped shapes of `planner` (planner/plan_shapes.json); warm-up and cool-down, unless
    given, as the recording nearest `cache_ratio` ran them (generate's defaults for the planner)."""
    shapes = load_plan_shapes(path).get(planner)
    if not shapes:
        raise ConfigError(f"--planner {planner!r}: no recorded plan shapes in {path}")
    ratios = ", ".join(f"{s.cache_ratio:g}" for s in shapes)
    near = min(shapes, key=lambda s: abs(s.cache_ratio - cache_ratio))
    return PlanSource(
        f"recorded plan shapes {path.name} ({planner}, cache ratio {cache_ratio:g}; recorded at {ratios})",
        tuple(shapes),
        cache_ratio,
        own_group,
        near.warmup if warmup is None else warmup,
        near.cooldown if cooldown is None else cooldown,
    )


def report_source(
    path: Path,
    own_group: str | None = None,
    warmup: int | None = None,
    cooldown: int | None = None,
    item_id: str | None = None,
) -> PlanSource:
    """A DiTango run's report.json: the shape of one item's plan file (`item_id`, else the
    report's first DiTango item; named in the description) with its planner and cache ratio,
    its own-group mode, warm-up and cool-down unless given; or without a plan file its mean
    computed fraction over all steps, for every unit."""
    where = f"--plan {path}"
    try:
        report = read_json_file(path, "--plan", TEXT_LIMIT)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file (a report.json of a --parallel ditango run)") from None
    listed = report.get("items") if isinstance(report, dict) else None
    if not isinstance(listed, list) or not all(isinstance(i, dict) for i in listed):
        raise ConfigError(f"{where}: not a report of ditango (a JSON object whose items are objects)")
    items = [i for i in listed if isinstance(i.get("attention"), dict) and i["attention"].get("per_step")]
    if not items:
        raise ConfigError(f"{where}: the report has no DiTango item (attention.per_step); run with --parallel ditango")
    chosen = [i for i in items if item_id is None or i.get("id") == item_id]
    named = [str(i.get("id", f"#{n + 1}")) for n, i in enumerate(items)]
    if not chosen:
        raise ConfigError(f"--plan-item {item_id}: not a DiTango item of {path}; its DiTango items: {', '.join(named)}")
    item = {"id": named[items.index(chosen[0])], **chosen[0]}
    attention = item["attention"]
    per_step = attention["per_step"]
    if not isinstance(per_step, list) or not all(_fraction(f) for f in per_step):
        raise ConfigError(f"{where}: item {item['id']}: attention.per_step must list fractions in [0, 1]")
    own_group = own_group or attention.get("own_group") or "decide"
    if own_group not in OWN_GROUP_MODES:
        raise ConfigError(
            f"{where}: item {item['id']}: own_group must be one of {', '.join(OWN_GROUP_MODES)}, got {own_group!r}"
        )
    plan_name = attention.get("plan_file")
    plan_file = path.parent / plan_name if isinstance(plan_name, str) and plan_name else None
    if plan_file is None or not plan_file.is_file():
        fraction = sum(per_step) / len(per_step)
        return PlanSource(
            f"{path} item {item['id']} (no plan file: its all-steps fraction {fraction:.4f} for every unit)",
            own_group=own_group,
            fallback=fraction,
        )
    planner = attention.get("planner") or "hpdc"
    ratio = (report.get("options") or {}).get("cache_ratio", RUN_DEFAULTS.cache_ratio)
    if planner not in PLANNERS or not _fraction(ratio) or ratio == 1:
        raise ConfigError(
            f"{where}: item {item['id']}: planner {planner!r} or options.cache_ratio {ratio!r} "
            f"is not a run's (one of {', '.join(PLANNERS)}; a ratio in [0, 1))"
        )
    try:
        shape = plan_shape(read_json_file(plan_file, "--plan: plan file", TEXT_LIMIT), planner, ratio)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
        raise ConfigError(
            f"{where}: its plan file {plan_file} is not a DiTango plan file (steps with a kind and "
            "compute rows of '0'/'1')"
        ) from None
    return PlanSource(
        f"{path} item {item['id']} (its plan file's shape: {planner}, cache ratio {ratio:g}, per decision unit)",
        (shape,),
        ratio,
        own_group,
        shape.warmup if warmup is None else warmup,
        shape.cooldown if cooldown is None else cooldown,
    )
