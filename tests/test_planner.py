"""DiTango planner (docs/ALGORITHMS.md 2.2-2.3) on synthetic inputs: no processes, no model.

Shape legend: B batch, S tokens, H heads, L layers, U remote units.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from planner.ditango import (
    DiTangoPlanner,
    PlannerConfig,
    alpha_factors,
    ase,
    budget_scores,
    compressed_state,
    drift,
    importance_weights,
    relative_drift,
    softmax_mass,
    unit_offsets,
)
from planner.plan import PlanLog, StepPlan
from runtime.state import AttentionState, merge_all

FP32_RTOL = 1e-6


class FakeRun:
    """A runtime stand-in with known locality.

    Per layer, the local compressed state moves on a straight line C_l(t) = base_l + t v_l
    (|v_l| equal on all layers, so every unit sees the same drift per step). Importance
    comes from per-unit lse norms; each cell's drift reference is the local state at the
    cell's last refresh (anchor or COMPUTE), as in 2.3. Gate = mean over layers of the
    relative drift since the anchor (tiny here: |base| >> |v|).
    """

    def __init__(self, layers: int, lse_norms: list[float], speed: float = 1e-3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.base_LBSH = torch.randn(layers, 1, 8, 2, generator=g) + 3.0
        v = torch.randn(layers, 1, 8, 2, generator=g)
        self.v_LBSH = torch.stack([vl / torch.linalg.vector_norm(vl) * speed for vl in v])
        weights = importance_weights(torch.tensor(lse_norms))
        self.w_LU = weights[:-1].expand(layers, -1)  # the last entry is the local group
        self.layers, self.units = self.w_LU.shape
        self.ase_by_step: dict[int, torch.Tensor] = {}

    def c(self, t: int) -> torch.Tensor:
        return self.base_LBSH + t * self.v_LBSH

    def execute(self, p: StepPlan) -> None:
        c = self.c(p.step)
        if p.kind == "anchor":
            self.anchor_LBSH = c.clone()
            self.ref_LUBSH = c.unsqueeze(1).repeat(1, self.units, 1, 1, 1)
        elif p.kind == "selective":
            self.ref_LUBSH[p.compute_LU] = c.unsqueeze(1).expand_as(self.ref_LUBSH)[p.compute_LU]

    def measure(self, t: int) -> tuple[torch.Tensor, float]:
        c = self.c(t)
        rows = []
        for layer in range(self.layers):
            drift_U = torch.stack([drift(c[layer], self.ref_LUBSH[layer, u]) for u in range(self.units)])
            rows.append(ase(self.w_LU[layer], drift_U))
        gate = sum(relative_drift(c[layer], self.anchor_LBSH[layer]) for layer in range(self.layers)) / self.layers
        self.ase_by_step[t] = torch.stack(rows)
        return self.ase_by_step[t], gate


def drive(planner: DiTangoPlanner, run: FakeRun) -> list[StepPlan]:
    plans = []
    for step in range(planner.steps):
        p = planner.plan(step)
        run.execute(p)
        if p.kind == "selective":
            planner.observe(step, *run.measure(step))
        plans.append(p)
    return plans


def drive_fixed(planner: DiTangoPlanner, ase_fn, gate_fn=lambda step: 0.0) -> list[StepPlan]:
    """Drive with ASE / gate given directly as functions of the step."""
    plans = []
    for step in range(planner.steps):
        p = planner.plan(step)
        if p.kind == "selective":
            planner.observe(step, ase_fn(step), gate_fn(step))
        plans.append(p)
    return plans


# --- estimators -----------------------------------------------------------------------


def test_importance_weights_known_values():
    # s = [0, 2]: mean 1, population std 1 -> softmax([-2, 0]) = [1, e^2] / (1 + e^2)
    w = importance_weights(torch.tensor([0.0, 2.0]))
    assert w.dtype == torch.float32
    assert torch.allclose(w, torch.tensor([0.119203, 0.880797]), atol=1e-6)
    # s = [1, 2, 3]: T = sqrt(2/3); exponents [-2, -1, 0] / T
    t = math.sqrt(2 / 3)
    e = [math.exp(-2 / t), math.exp(-1 / t), 1.0]
    w = importance_weights(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.allclose(w, torch.tensor([x / sum(e) for x in e]), rtol=1e-5)
    assert torch.allclose(w, torch.tensor([0.062556, 0.212896, 0.724548]), atol=1e-6)


def test_importance_weights_sum_to_one_per_row_and_keep_shape():
    s = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(1)) * 100
    w = importance_weights(s)
    assert w.shape == s.shape
    assert torch.allclose(w.sum(-1), torch.ones(2, 3), atol=1e-6)
    assert torch.equal(w.argmax(-1), s.argmax(-1))


@pytest.mark.parametrize("value", [0.0, 5.0, 1e6])
def test_importance_weights_equal_scores_are_uniform(value):
    """std = 0: the temperature clamp (1e-6) must give uniform weights, not 0/0 = NaN."""
    w = importance_weights(torch.full((4,), value))
    assert torch.isfinite(w).all()
    assert torch.allclose(w, torch.full((4,), 0.25))


def test_state_estimators():
    out_BSHD = torch.tensor([1.0, 2.0, 3.0, 6.0]).reshape(1, 1, 1, 4).expand(2, 3, 2, 4)
    c = compressed_state(out_BSHD.double())
    assert c.shape == (2, 3, 2) and c.dtype == torch.float32
    assert torch.all(c == 3.0)
    d = drift(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2))
    assert d.shape == () and d.dtype == torch.float32 and d.item() == 5.0
    assert relative_drift(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 2.0])) == pytest.approx(math.sqrt(13) / 2)
    assert relative_drift(torch.ones(3), torch.zeros(3)) == 0.0
    alpha = alpha_factors(torch.tensor([2.0, 1.0, 0.5]), torch.tensor(4.0))
    assert torch.allclose(alpha, torch.tensor([0.5, 0.25, 0.125]))
    w, dr = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([1.0, 2.0, 4.0])
    assert torch.allclose(ase(w, dr), torch.tensor([0.5, 0.6, 0.8]))
    assert torch.allclose(ase(w, dr, alpha), torch.tensor([0.25, 0.15, 0.1]))


# --- decisions on a fake run with known locality ------------------------------------------


def locality_run():
    # ring offsets 1..4: near units carry large lse norms, far ones small; local is last
    run = FakeRun(layers=3, lse_norms=[9.0, 7.0, 5.0, 3.0, 10.0])
    planner = DiTangoPlanner(PlannerConfig(cache_ratio=0.5, warmup=2, cooldown=2), steps=20, layers=3, units=4)
    return run, planner, drive(planner, run)


def test_far_units_are_reused_first():
    run, _, plans = locality_run()
    assert [p.kind for p in plans[:5]] == ["exact", "exact", "anchor", "selective", "selective"]
    assert not plans[3].compute_LU.any(), "the step right after an anchor reuses every remote unit"
    # equal drift everywhere, so ASE order = importance order: near computed, far reused
    assert torch.equal(plans[4].compute_LU, torch.tensor([[True, True, False, False]] * 3))
    assert plans[4].epsilon == pytest.approx(float(torch.quantile(run.ase_by_step[3].flatten(), 0.5)), rel=FP32_RTOL)


def test_growing_drift_triggers_recompute():
    """Unit 3 (farthest, lightest) is reused while its drift grows, until ASE reaches epsilon."""
    run, _, plans = locality_run()
    eps = plans[4].epsilon
    reused = [t for t in range(4, 18) if not plans[t].compute_LU[:, 3].any()]
    first_compute = next(t for t in range(4, 18) if plans[t].compute_LU[:, 3].all())
    assert first_compute > 4 and reused[: first_compute - 4] == list(range(4, first_compute))
    series = [run.ase_by_step[t][:, 3] for t in range(3, first_compute)]
    assert all(bool((b > a).all()) for a, b in zip(series, series[1:], strict=False)), "drift must grow"
    assert bool((series[-1] >= eps).all()) and bool((series[-2] < eps).all())
    # after the refresh its drift restarts from zero and it is reused again
    assert not plans[first_compute + 1].compute_LU[:, 3].any()


def test_alternation_of_near_units_and_no_extra_anchor():
    """A small gate (|base| >> |v|) and no options: one anchor for the whole run."""
    _, planner, plans = locality_run()
    assert planner.log().summary()["anchors"] == [2]
    assert [p.kind for p in plans[18:]] == ["exact", "exact"]


# --- anchors ----------------------------------------------------------------------------

GRID_LU = torch.tensor([[0.4, 0.3, 0.2, 0.1]])  # distinct ASE values; median 0.25


@pytest.mark.parametrize(("gate", "anchor"), [(0.31, True), (0.3, True), (0.29, False)])
def test_anchor_gate(gate, anchor):
    """Threshold = gate_factor * cache_ratio = 0.6 * 0.5 = 0.3; reached means anchor."""
    planner = DiTangoPlanner(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1), steps=8, layers=1, units=4)
    assert [planner.plan(s).kind for s in range(3)] == ["exact", "anchor", "selective"]
    planner.observe(2, GRID_LU, gate)
    p = planner.plan(3)
    if anchor:
        assert p.kind == "anchor" and p.compute_LU.all() and p.epsilon is None and planner.epsilon is None
        assert planner.plan(4).kind == "selective" and not planner.log().steps[4].compute_LU.any()
    else:
        assert p.kind == "selective" and p.compute_LU.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize(
    ("rule", "kinds"),
    [
        (True, ["anchor", "selective", "anchor", "selective", "anchor"]),
        (False, ["anchor", "selective", "selective", "selective", "selective"]),  # the authors' code
    ],
)
def test_every_cell_computed_is_an_anchor_only_with_the_rule(rule, kinds):
    cfg = PlannerConfig(cache_ratio=0.5, warmup=0, cooldown=0, anchor_when_all=rule)
    planner = DiTangoPlanner(cfg, steps=5, layers=2, units=3)
    plans = drive_fixed(planner, lambda step: torch.full((2, 3), 0.7))  # quantile = 0.7, all >= 0.7
    assert [p.kind for p in plans] == kinds
    # the same cells computed either way: everything on steps 2 and 4, but only the anchor refreshes importance
    assert plans[2].compute_LU.all() and plans[4].compute_LU.all()
    assert planner.log().summary()["anchors"] == [i for i, k in enumerate(kinds) if k == "anchor"]


def stale_ase(step: int) -> torch.Tensor:
    # first selective step (2): the grid sets epsilon 0.25 -> units 0, 1 computed at step 3;
    # afterwards every ASE is below epsilon, so only staleness can force a recompute
    return GRID_LU if step == 2 else torch.tensor([[0.0, 0.0, 0.1, 0.1]])


@pytest.mark.parametrize(("tau_max", "step4"), [(None, [False] * 4), (3, [False, False, True, True])])
def test_tau_max_recomputes_stale_cell(tau_max, step4):
    cfg = PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1, tau_max=tau_max)
    plans = drive_fixed(DiTangoPlanner(cfg, steps=8, layers=1, units=4), stale_ase)
    assert plans[3].compute_LU.tolist() == [[True, True, False, False]]
    # units 2, 3 were last computed at the anchor (step 1): age 3 at step 4
    assert plans[4].kind == "selective" and plans[4].compute_LU.tolist() == [step4]


def test_tau_max_anchor_when_every_cell_is_stale():
    cfg = PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1, tau_max=2)
    plans = drive_fixed(DiTangoPlanner(cfg, steps=8, layers=1, units=4), stale_ase)
    # every cell was reused at step 2, so all are 2 steps old at step 3: all computed, no anchor
    assert [p.kind for p in plans] == ["exact", "anchor"] + ["selective"] * 5 + ["exact"]
    assert plans[3].compute_LU.all()
    plans = drive_fixed(DiTangoPlanner(replace(cfg, anchor_when_all=True), steps=8, layers=1, units=4), stale_ase)
    assert [p.kind for p in plans] == [
        "exact",
        "anchor",
        "selective",
        "anchor",
        "selective",
        "anchor",
        "selective",
        "exact",
    ]


@pytest.mark.parametrize(
    ("interval", "anchors"), [(None, [1]), (3, [1, 4, 7, 10]), (2, [1, 3, 5, 7, 9, 11]), (1, list(range(1, 12)))]
)
def test_anchor_interval(interval, anchors):
    cfg = PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1, anchor_interval=interval)
    planner = DiTangoPlanner(cfg, steps=13, layers=1, units=4)
    drive_fixed(planner, lambda step: GRID_LU)
    assert planner.log().summary()["anchors"] == anchors


@pytest.mark.parametrize("interval", [None, 1])
def test_never_an_anchor_in_cooldown(interval):
    """The gate fires after every selective step; cool-down steps stay exact anyway."""
    cfg = PlannerConfig(cache_ratio=0.5, warmup=2, cooldown=3, anchor_interval=interval)
    plans = drive_fixed(DiTangoPlanner(cfg, steps=10, layers=2, units=2), lambda s: torch.rand(2, 2), lambda s: 1.0)
    kinds = [p.kind for p in plans]
    assert kinds[:2] == ["exact"] * 2 and kinds[7:] == ["exact"] * 3
    assert "anchor" in kinds[2:7] and all(k != "selective" or kinds[i - 1] == "anchor" for i, k in enumerate(kinds))


# --- exact steps --------------------------------------------------------------------------


def test_warmup_and_cooldown_are_exact():
    planner = DiTangoPlanner(PlannerConfig(cache_ratio=0.4, warmup=3, cooldown=4), steps=12, layers=2, units=3)
    plans = drive_fixed(planner, lambda step: torch.arange(6.0).reshape(2, 3))
    kinds = [p.kind for p in plans]
    assert kinds[:4] == ["exact", "exact", "exact", "anchor"] and kinds[8:] == ["exact"] * 4
    assert set(kinds[4:8]) == {"selective"}
    assert all(p.compute_LU.all() and p.epsilon is None for p in plans if p.kind == "exact")


@pytest.mark.parametrize(
    ("cfg", "units"),
    [
        (PlannerConfig(cache_ratio=0.0, warmup=0, cooldown=0), 3),  # cache_ratio 0 = exact
        (PlannerConfig(cache_ratio=0.5, warmup=0, cooldown=0), 0),  # one group: nothing remote
        (PlannerConfig(cache_ratio=0.5, warmup=4, cooldown=2), 3),  # warm-up + cool-down cover all
    ],
)
def test_exact_everywhere(cfg, units):
    planner = DiTangoPlanner(cfg, steps=6, layers=2, units=units)
    plans = [planner.plan(s) for s in range(6)]  # no observe needed: nothing is selective
    assert [p.kind for p in plans] == ["exact"] * 6
    assert all(p.compute_LU.shape == (2, units) and p.compute_LU.all() for p in plans)
    summary = planner.log().summary()
    assert summary["computed_fraction_all_steps"] == 1.0 and summary["computed_fraction_selective"] is None
    assert summary["per_step"] == [1.0] * 6 and summary["anchors"] == []
    assert summary["steps"] == {"exact": 6, "anchor": 0, "selective": 0}


# --- epsilon ---------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_epsilon_is_the_cache_ratio_quantile(ratio):
    layers, units = 4, 5
    values_LU = (torch.randperm(20, generator=torch.Generator().manual_seed(3)).float() + 1).reshape(layers, units)
    planner = DiTangoPlanner(PlannerConfig(cache_ratio=ratio, warmup=1, cooldown=0), 8, layers, units)
    plans = drive_fixed(planner, lambda step: values_LU if step == 2 else values_LU.flip(0) * 0.01 + step)
    eps = float(torch.quantile(values_LU.flatten(), ratio))
    assert plans[2].epsilon is None
    assert plans[3].epsilon == eps
    assert torch.equal(plans[3].compute_LU, values_LU >= eps)
    assert 1 - plans[3].compute_LU.float().mean().item() == pytest.approx(ratio, abs=1e-9)
    # held until the next anchor, whatever later ASE values are
    assert all(p.epsilon == eps for p in plans[3:] if p.kind == "selective")


# --- protocol and state -------------------------------------------------------------------


def test_protocol_violations_raise():
    planner = DiTangoPlanner(PlannerConfig(warmup=1, cooldown=1), steps=6, layers=1, units=2)
    with pytest.raises(AssertionError, match="out of order"):
        planner.plan(1)
    planner.plan(0)
    with pytest.raises(AssertionError):
        planner.observe(0, torch.zeros(1, 2), 0.0)  # exact step: nothing to observe
    planner.plan(1)
    planner.plan(2)
    with pytest.raises(AssertionError, match="observe\\(\\) was not called after step 2"):
        planner.plan(3)
    with pytest.raises(AssertionError):
        planner.observe(2, torch.zeros(2, 2), 0.0)  # wrong shape


def test_reset_and_rank_invariance():
    """Two planners fed the same (all-reduced) inputs produce the same plan hash; reset replays."""
    cfg = PlannerConfig(cache_ratio=0.5, warmup=2, cooldown=2, tau_max=4)
    hashes = []
    for _ in range(2):
        run = FakeRun(layers=3, lse_norms=[9.0, 7.0, 5.0, 3.0, 10.0])
        planner = DiTangoPlanner(cfg, steps=20, layers=3, units=4)
        drive(planner, run)
        hashes.append(planner.log().hash())
    assert hashes[0] == hashes[1]
    planner.reset()
    assert planner.log().steps == [] and planner.epsilon is None and planner.last_anchor is None
    drive(planner, FakeRun(layers=3, lse_norms=[9.0, 7.0, 5.0, 3.0, 10.0]))
    assert planner.log().hash() == hashes[0]
    text = repr(planner)
    assert "tensor" not in text and "steps=20" in text and "anchors=" in text


def test_returned_plan_is_a_copy():
    planner = DiTangoPlanner(PlannerConfig(warmup=0, cooldown=0), steps=3, layers=1, units=2)
    planner.plan(0).compute_LU.fill_(False)
    assert planner.log().steps[0].compute_LU.all()


# --- PlanLog -----------------------------------------------------------------------------


def hand_log() -> PlanLog:
    t, f = True, False
    return PlanLog(
        [
            StepPlan(0, "exact", torch.tensor([[t, t], [t, t]]), None),
            StepPlan(1, "anchor", torch.tensor([[t, t], [t, t]]), None),
            StepPlan(2, "selective", torch.tensor([[f, f], [f, f]]), None),
            StepPlan(3, "selective", torch.tensor([[t, f], [f, f]]), 0.5),
            StepPlan(4, "selective", torch.tensor([[t, t], [t, f]]), 0.5),
            StepPlan(5, "anchor", torch.tensor([[t, t], [t, t]]), None),
            StepPlan(6, "selective", torch.tensor([[f, f], [f, f]]), None),
            StepPlan(7, "exact", torch.tensor([[t, t], [t, t]]), None),
        ]
    )


def test_plan_log_summary():
    s = hand_log().summary()
    assert s["anchors"] == [1, 5]
    assert s["epsilon"] == [{"anchor": 1, "epsilon": 0.5}, {"anchor": 5, "epsilon": None}]
    assert s["kinds"] == ["exact", "anchor", "selective", "selective", "selective", "anchor", "selective", "exact"]
    assert s["compute_map"] == [[1, 1], [1, 1], [0, 0], [0.5, 0], [1, 0.5], [1, 1], [0, 0], [1, 1]]
    assert s["per_step"] == [1, 1, 0, 0.25, 0.75, 1, 0, 1]
    assert s["computed_fraction_selective"] == 0.25  # 4 fresh of 16 selective cells
    assert s["computed_fraction_all_steps"] == 0.625  # 20 of 32: exact and anchor steps compute everything
    assert s["computed_fraction_by_unit"] == [0.6875, 0.5625]  # 11 and 9 of 16
    assert s["steps"] == {"exact": 2, "anchor": 2, "selective": 4}
    assert json.loads(json.dumps(s)) == s


def test_plan_log_hash_round_trip_and_sensitivity():
    log = hand_log()
    h = log.hash()
    assert len(h) == 64 and int(h, 16) >= 0
    back = PlanLog.from_json(json.loads(json.dumps(log.to_json())))
    assert back.hash() == h
    assert all(torch.equal(a.compute_LU, b.compute_LU) for a, b in zip(log.steps, back.steps, strict=True))
    flipped = PlanLog.from_json(log.to_json())
    flipped.steps[4].compute_LU[1, 1] = True
    assert flipped.hash() != h
    moved = PlanLog.from_json(log.to_json())
    moved.steps[3].epsilon = 0.5000001
    assert moved.hash() != h
    # below 9 significant digits: same decision record
    moved.steps[3].epsilon = 0.5 + 1e-12
    assert moved.hash() == h


def test_plan_log_round_trip_from_planner_and_no_units():
    run, planner, _ = locality_run()
    log = planner.log()
    assert PlanLog.from_json(json.loads(json.dumps(log.to_json()))).hash() == log.hash()
    empty = DiTangoPlanner(PlannerConfig(), steps=2, layers=3, units=0)
    empty.plan(0), empty.plan(1)
    back = PlanLog.from_json(empty.log().to_json())
    assert back.steps[0].compute_LU.shape == (3, 0) and back.hash() == empty.log().hash()
    with pytest.raises(ValueError, match="format"):
        PlanLog.from_json({"steps": []})


# --- decision units ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "size", "mode", "compose", "units"),
    [
        (4, 2, "decide", 1, [(0,), (1,), (2,), (3,)]),  # the authors': the own group's others are unit 0
        (4, 2, "fresh", 1, [(1,), (2,), (3,)]),  # the whole own group always fresh
        (4, 1, "decide", 1, [(1,), (2,), (3,)]),  # a group of one: nothing but the own chunk
        (6, 4, "decide", 2, [(0,), (1, 2), (3, 4), (5,)]),  # composition takes remote groups only
        (1, 2, "decide", 1, [(0,)]),  # one group of two: the partner is the only unit
        (1, 1, "fresh", 1, []),
    ],
)
def test_unit_offsets(groups, size, mode, compose, units):
    assert unit_offsets(groups, size, mode, compose) == units


def test_two_entry_importance_is_data_independent_three_entries_are_not():
    """Why the own group's partner is a decision unit: with one remote unit and the local
    entry the std-temperature softmax is 0.119 / 0.881 whatever the norms; one more entry
    (the partner) and the weights follow the data."""
    for norms in ([1.0, 2.0], [5.0, 300.0], [40.0, 41.0]):
        assert torch.allclose(importance_weights(torch.tensor(norms)), torch.tensor([0.119203, 0.880797]), atol=1e-6)
    a = importance_weights(torch.tensor([1.0, 2.0, 3.0]))
    b = importance_weights(torch.tensor([1.0, 2.9, 3.0]))
    assert not torch.allclose(a, b, atol=1e-2)


def test_softmax_mass_is_each_partition_share_of_the_merged_output():
    g = torch.Generator().manual_seed(4)
    states = [
        AttentionState(torch.randn(1, 6, 2, 4, generator=g), torch.randn(1, 6, 2, generator=g) * 3) for _ in range(3)
    ]
    total = merge_all(states)
    mass = torch.stack([softmax_mass(s.lse_BSH, total.lse_BSH) for s in states])
    assert mass.sum().item() == pytest.approx(1.0, rel=1e-5)
    share = torch.softmax(torch.stack([s.lse_BSH for s in states]), dim=0).mean(dim=(1, 2, 3))
    assert torch.allclose(mass, share, rtol=1e-5)
    assert torch.equal(budget_scores(torch.tensor([0.5, 0.25]), torch.tensor([1, 3])), torch.tensor([0.5, 0.75]))


# --- the budget planner ----------------------------------------------------------------


def drive_budget(planner: DiTangoPlanner, score_fn) -> list[StepPlan]:
    plans = []
    for step in range(planner.steps):
        p = planner.plan(step)
        if planner.observes(p.kind):
            planner.observe(step, score_fn(step), 1.0)  # a gate that would always fire under hpdc
        plans.append(p)
    return plans


@pytest.mark.parametrize(("ratio", "quota"), [(0.5, 6.0), (0.75, 3.0), (0.9, 1.2), (0.99, 0.12)])
def test_budget_computes_its_quota_of_the_largest_scores(ratio, quota):
    """(1 - ratio) x 12 cells per selective step, a fraction carried over: any first n steps
    compute round(n x quota) cells; one anchor after the warm-up, no gate."""
    layers, units = 3, 4
    g = torch.Generator().manual_seed(7)
    scores = {s: torch.rand(layers, units, generator=g) for s in range(12)}
    cfg = PlannerConfig(cache_ratio=ratio, warmup=2, cooldown=2, planner="budget", front_load=1.0)
    planner = DiTangoPlanner(cfg, steps=12, layers=layers, units=units)
    plans = drive_budget(planner, scores.__getitem__)
    assert [p.kind for p in plans] == ["exact"] * 2 + ["anchor"] + ["selective"] * 7 + ["exact"] * 2
    counts = [int(p.compute_LU.sum()) for p in plans[3:10]]
    assert [sum(counts[: n + 1]) for n in range(7)] == [round((n + 1) * quota) for n in range(7)]
    for p in plans[3:10]:
        if p.compute_LU.any():  # the chosen cells are the previous step's largest scores
            prev = scores[p.step - 1].flatten()
            chosen, rest = prev[p.compute_LU.flatten()], prev[~p.compute_LU.flatten()]
            assert chosen.min() >= (rest.max() if rest.numel() else -1)
            assert p.epsilon == pytest.approx(float(chosen.min()))
    summary = planner.log().summary()
    assert summary["computed_fraction_selective"] == round(sum(counts) / (7 * 12), 6)
    assert summary["computed_fraction_all_steps"] == pytest.approx((5 * 12 + sum(counts)) / (12 * 12), abs=1e-6)
    assert summary["anchors"] == [2]


@pytest.mark.parametrize("front", [1.0, 1.6, 2.0, 0.5])
def test_budget_front_load_keeps_the_mean_quota(front):
    """The quota falls linearly from front x mean to (2 - front) x mean; the run's total is the
    flat one's (round(n x quota) over the n selective steps)."""
    cfg = PlannerConfig(cache_ratio=0.75, warmup=5, cooldown=0, planner="budget", front_load=front)
    planner = DiTangoPlanner(cfg, steps=50, layers=4, units=3)
    counts = [planner.budget_cells(i) for i in range(44)]
    assert sum(counts) == 44 * 3 and all(c >= 0 for c in counts)
    first, last = sum(counts[:11]), sum(counts[-11:])
    if front == 1.0:
        assert counts == [3] * 44
    else:  # first quarter minus last quarter of the linear rate: 132 x 0.375 x (front - 1) cells
        assert abs((first - last) - 132 * 0.375 * (front - 1)) <= 2, (first, last)


def test_budget_plans_the_step_after_an_anchor_and_ignores_the_gate():
    cfg = PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1, planner="budget", front_load=1.0)
    planner = DiTangoPlanner(cfg, steps=8, layers=1, units=4)
    assert planner.observes("anchor") and planner.observes("selective") and not planner.observes("exact")
    assert planner.plan(0).kind == "exact" and planner.plan(1).kind == "anchor"
    with pytest.raises(AssertionError, match="observe\\(\\) was not called after step 1"):
        planner.plan(2)
    planner.observe(1, torch.tensor([[0.1, 0.4, 0.3, 0.2]]), 1.0)  # a gate that fires under hpdc
    assert planner.plan(2).compute_LU.tolist() == [[False, True, True, False]]
    hpdc = DiTangoPlanner(replace(cfg, planner="hpdc"), steps=8, layers=1, units=4)
    assert not hpdc.observes("anchor")


def test_budget_anchors_come_only_from_tau_max_and_the_interval():
    score = lambda step: torch.tensor([[0.4, 0.3, 0.2, 0.1]])  # noqa: E731 - units 2, 3 never win
    base = PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1, planner="budget", front_load=1.0)
    plans = drive_budget(DiTangoPlanner(base, steps=12, layers=1, units=4), score)
    assert [p.kind for p in plans].count("anchor") == 1
    assert all(p.compute_LU.tolist() == [[True, True, False, False]] for p in plans[2:11])
    plans = drive_budget(DiTangoPlanner(replace(base, tau_max=4), steps=12, layers=1, units=4), score)
    # units 2, 3 last computed at the anchor (step 1): forced at steps 5 and 9, on top of the budget
    assert [t for t, p in enumerate(plans) if p.kind == "selective" and p.compute_LU.all()] == [5, 9]
    planner = DiTangoPlanner(replace(base, anchor_interval=4), steps=12, layers=1, units=4)
    drive_budget(planner, score)
    assert planner.log().summary()["anchors"] == [1, 5, 9]


def test_budget_plans_are_rank_invariant_and_zero_ratio_is_exact():
    cfg = PlannerConfig(cache_ratio=0.7, warmup=2, cooldown=2, planner="budget", tau_max=5)
    hashes = []
    for _ in range(2):
        g = torch.Generator().manual_seed(11)
        scores = {s: torch.rand(3, 4, generator=g) for s in range(20)}
        planner = DiTangoPlanner(cfg, steps=20, layers=3, units=4)
        drive_budget(planner, scores.__getitem__)
        hashes.append(planner.log().hash())
    assert hashes[0] == hashes[1]
    exact = DiTangoPlanner(replace(cfg, cache_ratio=0.0), steps=6, layers=3, units=4)
    assert [exact.plan(s).kind for s in range(6)] == ["exact"] * 6
