"""DiTango in a rehearsal (runtime/rehearse/): no attention states to plan from, so each
step replays the plan shape `ditango simulate` records (planner/plan_shape.py), and a sample
of the steps runs (the first of each kind the plan has, and every expert switch)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from planner.layout import chunk_sizes
from planner.plan import StepPlan
from runtime.config import RunConfig


class ReplayPlanner:
    """DiTango's planner replaced by fixed plans per step (a rehearsal has no attention
    states to plan from): the interface SelectiveRuntime uses."""

    def __init__(self, plans: dict[int, StepPlan], planner_class) -> None:
        self.plans = plans
        self.observes_anchors = planner_class.observes_anchors
        self.keeps_exact_states = planner_class.keeps_exact_states
        self.switches: tuple[int, ...] = ()
        self._last: StepPlan | None = None

    def plan(self, step: int) -> StepPlan:
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        p = self.plans[step]
        self._last = p
        mode = detect_fake_mode()
        with unset_fake_temporarily():
            bits = p.compute_LU.clone()
        if mode is not None:  # a fake host tensor that carries its values (see CONSTANT_LIMIT)
            bits = mode.fake_tensor_converter.from_real_tensor(mode, bits, make_constant=True)
        return StepPlan(p.step, p.kind, bits, p.epsilon)

    def observes(self, kind: str) -> bool:
        return kind == "selective" or (kind == "anchor" and self.observes_anchors)

    def observe(self, step, scores_LU, gate) -> None: ...

    def not_run(self, step, missing_L) -> None: ...

    def last_plan(self) -> StepPlan:
        assert self._last is not None
        return self._last


def spread(fraction: float, layers: int) -> list[bool]:
    """`fraction` of `layers` as evenly spaced True layers (round(fraction x layers) of them)."""
    n = round(fraction * layers)
    return [(i + 1) * n // layers > i * n // layers for i in range(layers)]


def replayed_plans(cfg: RunConfig, layers: int, steps: int, switches: tuple[int, ...]) -> dict[int, StepPlan]:
    """Per step, the plan simulate prices for this layout (the recorded plan shape at the run's
    cache ratio, planner/plan_shape.py): exact warm-up and cool-down steps, an anchor after the
    warm-up and at each expert switch, the other steps selective with each unit computed in an
    evenly spread round(fraction x layers) of the layers."""
    from planner.plan_shape import recorded_source

    planner = cfg.ditango.planner
    source = recorded_source(planner.planner, planner.cache_ratio, planner.own_group, planner.warmup, planner.cooldown)
    replay = source.replay(cfg.layout, layers, steps)
    fractions = replay.selective_U
    units = len(fractions)
    plans = {}
    for step in range(steps):
        if replay.selective + replay.anchors == 0 or step < planner.warmup or step >= steps - planner.cooldown:
            kind, bits = "exact", torch.ones(layers, units, dtype=torch.bool)
        elif step == planner.warmup or step in switches:
            kind, bits = "anchor", torch.ones(layers, units, dtype=torch.bool)
        else:
            kind = "selective"
            bits = torch.tensor([spread(f, layers) for f in fractions], dtype=torch.bool).T.reshape(layers, units)
        plans[step] = StepPlan(step, kind, bits, None)
    return plans


def sample_steps(plans: dict[int, StepPlan] | None, steps: int, switches: tuple[int, ...]) -> list[int]:
    """The steps a rehearsal runs: the first of each kind the plan has (two exact steps
    without DiTango: the multistep solver's first and second order), and each switch."""
    if not plans:
        return sorted({0, min(1, steps - 1), *switches})
    firsts: dict[str, int] = {}
    for step, p in sorted(plans.items()):
        firsts.setdefault(p.kind, step)
    return sorted({*firsts.values(), *switches})


def rehearsed_ranks(cfg: RunConfig, all_ranks: bool) -> list[int]:
    """The ranks whose shapes differ: the first (the writer), the last, the first rank of each
    distinct chunk size and of each CFG group; every rank with `all_ranks`."""
    layout = cfg.layout
    if all_ranks:
        return list(range(layout.world_size))
    tokens = cfg.items[0].tokens()
    sizes = [tokens] if layout.strategy.splits_weights else chunk_sizes(tokens, layout.cp_degree)
    first_of_size = {size: c for c, size in reversed(list(enumerate(sizes)))}
    ranks = {0, layout.world_size - 1, *first_of_size.values()}
    if layout.cfg_degree == 2:
        ranks.add(layout.cp_degree)
    return sorted(ranks)


def replay_on(selective, plans: dict[int, StepPlan] | None) -> None:
    """DiTango's runtime with the replayed plans, its agreed cache cap the rank's own."""
    allocate, agree = selective.allocate, selective._agree_min

    def replayed_allocate(*args, **kwargs):
        allocate(*args, **kwargs)
        # Where the run would find reuse does not pay it runs every step exact (its own planner
        # says so): so does its rehearsal.
        if not selective.exact_only:
            selective.planner = ReplayPlanner(plans or {}, selective.planner_class)

    def replayed_end_step(step: int) -> None:
        """end_step's collectives (the statistics a planner would observe), without its host
        bookkeeping of values the rehearsal does not have."""
        plan = selective.step_plan
        group, ranks = selective._plan_group()
        if group is not None and selective.planner.observes(plan.kind):
            stats = torch.zeros(selective.layers * selective.units + 1, device=selective.control_device)
            selective.comm.all_reduce(stats, dist.ReduceOp.SUM, group, ranks)

    selective.allocate = replayed_allocate
    selective.end_step = replayed_end_step
    selective._agree_min = lambda value: (agree(value), value)[1]
