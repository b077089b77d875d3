"""The "budget" planner, and its statistics.

Every selective step computes (1 - cache_ratio) x cells cells (a fraction carried over to
the next steps), those with the largest predicted error if reused one step more
(`budget_scores`: the cell's measured error rate x the age its cache would have). Rates are
measured whenever a cell is recomputed, on exact steps too, so the first selective step
follows the warm-up directly (its states are the cache) and no statistic goes stale that an
anchor would refresh: anchors come only from expert switches, tau_max, anchor_interval or
anchor_when_all.

Shape legend: N CFG branches, L layers, U units, B batch, S local tokens, H heads.
"""

from __future__ import annotations

import torch

from planner.hpdc import compressed_state
from planner.plan import StepPlan
from planner.schedule import StepPlanner, StepStatistics


def softmax_mass(lse_BSH: torch.Tensor, total_lse_BSH: torch.Tensor) -> torch.Tensor:
    """Mean over query rows (and heads) of a partition's share of the softmax, exp(lse - total
    lse): the weight its state has in the merged output (docs/ALGORITHMS.md 1). 0-d float32."""
    return torch.exp(lse_BSH.float() - total_lse_BSH.float()).mean()


def budget_scores(rate_U: torch.Tensor, age_U: torch.Tensor) -> torch.Tensor:
    """The budget planner's predicted error of reusing each unit at the next step: its error
    rate (relative output error per step of staleness) times the age its cache would have
    then (at least 1: a cell refreshed just now still goes one step stale). float32 [U];
    relative errors, so cells of different layers compare."""
    return rate_U.float() * age_U.float()


class BudgetStatistics(StepStatistics):
    """Each recomputed cell's error rate (the mass-weighted change of its state against the
    cached one, relative to the layer's output, per step of age), and every cell scored by
    rate x the age it would have next step; a cell not measured yet takes its softmax mass x
    the local relative drift of one step."""

    def allocate(self, batch: int, tokens: int, heads: int) -> None:
        N, L, U, d = self.branches, self.layers, self.units, self.device
        self.c_prev_NLBSH = torch.zeros(N, L, batch, tokens, heads, device=d)  # the previous step's C
        # Each cell's error rate (< 0: not measured yet) and the step its cache was last refreshed
        # (replicated: the plans are), on the host and on the device (a host tensor copied per
        # layer would stall the GPU stream each time).
        self.rate_NLU = torch.full((N, L, U), -1.0, device=d)
        self.refreshed_LU = torch.full((L, U), -1, dtype=torch.long)
        self.refreshed_dev_LU = torch.full((L, U), -1, dtype=torch.long, device=d)
        self.compute_dev_LU: torch.Tensor | None = None  # this step's compute bits, on the device
        self.step_plan: StepPlan | None = None
        self.steps_done = 0

    def nbytes(self) -> int:
        return self.c_prev_NLBSH.nbytes

    def begin_step(self, plan: StepPlan | None) -> None:
        super().begin_step(plan)
        if plan is None:
            return
        self.step_plan = plan
        self.compute_dev_LU = plan.compute_LU.to(self.device)  # once a step
        if plan.step in self.switches:
            self.rate_NLU.fill_(-1.0)  # the cached states are the other expert's: no rate to measure

    def measure(
        self, n: int, layer: int, plan: StepPlan, local, units: list, compute_U: list[bool], total, cached
    ) -> None:
        """Branch `n`, `layer`, before the cache takes this step's states: `cached(u)` is unit
        u's state as the cache holds it (what a reuse would have merged)."""
        self._measure_rates(n, layer, plan, units, compute_U, total, cached)
        c_now = compressed_state(local.out_BSHD)
        prev = self.c_prev_NLBSH[n, layer]
        c_norm = c_now.norm().clamp_min(torch.finfo(torch.float32).tiny)
        step_drift = (c_now - prev).norm() / c_norm if self.steps_done else torch.zeros((), device=c_now.device)
        prev.copy_(c_now)
        mass_U = torch.stack([softmax_mass(s.lse_BSH, total.lse_BSH) for s in units])
        self.ase_NLU[n, layer] = self.layer_scores(n, layer, plan, mass_U, step_drift)

    def layer_scores(self, n: int, layer: int, plan: StepPlan, mass_U: torch.Tensor, step_drift) -> torch.Tensor:
        """Predicted error of each cell if reused at the next step: its rate times its age then
        (1 for a cell computed now); a cell whose rate is not measured yet takes its mass times
        the local relative drift of one step. [U], on the device."""
        rate_U = self.rate_NLU[n, layer]
        rate_U = torch.where(rate_U >= 0, rate_U, mass_U * step_drift)
        # On the device (no host tensor per layer): 1 for a cell computed now (every cell of an
        # exact or anchor step), else since its refresh.
        age_U = torch.where(self.compute_dev_LU[layer], 1, plan.step + 1 - self.refreshed_dev_LU[layer])
        return budget_scores(rate_U, age_U)

    def _measure_rates(self, n, layer, plan, units, compute_U, total, cached) -> None:
        """Each recomputed cell's error had its cached state been reused: mass-weighted output
        change (first order, docs/ALGORITHMS.md 1) relative to the layer's output, per step of age."""
        if plan.step in self.switches:
            return
        total_norm = total.out_BSHD.norm().clamp_min(torch.finfo(torch.float32).tiny)
        for u, state in enumerate(units):
            age = plan.step - int(self.refreshed_LU[layer, u])
            if not compute_U[u] or age < 1 or self.refreshed_LU[layer, u] < 0:
                continue
            old = cached(u)
            weight_BSH1 = torch.exp(state.lse_BSH - total.lse_BSH).unsqueeze(-1)
            error = (weight_BSH1 * (state.out_BSHD - old.out_BSHD)).norm() / total_norm
            self.rate_NLU[n, layer, u] = error / age

    def end_step(self, step: int, plan: StepPlan, as_planned: bool) -> None:
        self.steps_done += 1
        self.refreshed_LU[plan.compute_LU] = step  # exact steps refresh the cache too
        done_LU = self.compute_dev_LU if as_planned else plan.compute_LU.to(self.device)
        self.refreshed_dev_LU.masked_fill_(done_LU, step)


class BudgetPlanner(StepPlanner):
    name = "budget"
    observes_anchors = True  # it plans the step after an anchor from the anchor's measurements
    keeps_exact_states = True  # exact steps' states are the first selective step's cache
    Statistics = BudgetStatistics

    def budget_cells(self, selective_index: int) -> int:
        """Cells computed on the `selective_index`-th selective step. The mean quota is
        (1 - cache_ratio) x cells per selective step, front-loaded: the rate falls linearly from
        front_load x quota to (2 - front_load) x quota over the n = steps - warm-up - cool-down
        - 1 selective steps a run with one anchor has. Cumulative counts are rounded, so the
        first i steps compute round(Q(i)) cells, Q the rate's integral."""
        quota = (1.0 - self.cfg.cache_ratio) * self.layers * self.units
        n = max(1, self.steps - self.cfg.warmup - self.cfg.cooldown - 1)
        a = self.cfg.front_load

        def cumulative(i: int) -> float:
            x = min(i, n) / n
            return quota * (n * (a * x + (1 - a) * x * x) + max(0, i - n))

        return round(cumulative(selective_index + 1)) - round(cumulative(selective_index))

    def _prepare(self, step: int, scores_LU: torch.Tensor, gate: float) -> None:
        """The gate is not used: anchors come from switches and the optional rules only."""
        if step < self.steps and not self._is_exact(step):
            compute_LU, cut = self._largest(scores_LU)
            self._prepared = self._decide(step, compute_LU, cut, gate_fired=False)

    def _largest(self, scores_LU: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """The budget's cells with the largest scores (ties: the lower layer, then the nearer
        unit, by a stable sort of replicated values) and the smallest score taken."""
        k = self.budget_cells(self._selective_steps)
        order = torch.argsort(scores_LU.flatten(), descending=True, stable=True)[:k]
        compute = torch.zeros(self.layers * self.units, dtype=torch.bool)
        compute[order] = True
        cut = float(scores_LU.flatten()[order[-1]]) if k else None
        return compute.reshape(self.layers, self.units), cut
