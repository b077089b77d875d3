"""The "hpdc" planner (default): the authors' HPDC'26 code (docs/ALGORITHMS.md 2.3), and its statistics.

The step after an anchor reuses every unit; from then on each step's plan is decided from
the previous step's accumulated state error (ASE = anchor importance x local drift):
COMPUTE where ASE >= epsilon, epsilon being the cache_ratio quantile of the ASE measured on
the first selective step of the anchor window; the anchor gate (mean relative local drift
since the anchor >= gate_factor x cache_ratio) makes the next step an anchor.

Shape legend: N CFG branches, L layers, U units, B batch, S local tokens, H heads, D head dim.
"""

from __future__ import annotations

import torch

from planner.plan import StepPlan
from planner.schedule import StepPlanner, StepStatistics

TEMPERATURE_MIN = 1e-6  # authors' clamp on the softmax temperature (std of the lse norms)
NORM_MIN = 1e-12  # a zero local output norm would make alpha infinite


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


class HpdcStatistics(StepStatistics):
    """Per layer: the compressed local state C = mean_D(local out); at anchors the units'
    importance (lse norms) and alpha; on selective steps the drift of C since each unit's last
    refresh (ASE) and the relative drift since the anchor (the gate)."""

    reference_states = True

    def allocate(self, batch: int, tokens: int, heads: int) -> None:
        N, L, U, d = self.branches, self.layers, self.units, self.device
        self.c_ref_NLUBSH = torch.zeros(N, L, U, batch, tokens, heads, device=d)  # each unit's C at its refresh
        self.c_anchor_NLBSH = torch.zeros(N, L, batch, tokens, heads, device=d)  # each layer's C at the anchor
        self.weights_NLU = torch.zeros(N, L, U, device=d)
        self.alpha_NLU = torch.ones(N, L, U, device=d)

    def nbytes(self) -> int:
        return self.c_ref_NLUBSH.nbytes + self.c_anchor_NLBSH.nbytes

    def measure(
        self, n: int, layer: int, plan: StepPlan, local, units: list, compute_U: list[bool], total, cached
    ) -> None:
        """Branch `n`, `layer`: `local` the own chunk's state, `units` each unit's (fresh or
        cached), `total` the merged one."""
        if plan.kind == "exact":
            return
        c_now = compressed_state(local.out_BSHD)
        c_ref_UBSH = self.c_ref_NLUBSH[n, layer]
        if plan.kind == "anchor":
            norms = torch.stack([s.lse_BSH.norm() for s in units] + [local.lse_BSH.norm()])
            self.weights_NLU[n, layer] = importance_weights(norms)[:-1]
            if self.cfg.use_alpha:
                out_norms = torch.stack([s.out_BSHD.norm() for s in units])
                self.alpha_NLU[n, layer] = alpha_factors(out_norms, local.out_BSHD.norm())
            self.c_anchor_NLBSH[n, layer].copy_(c_now)
            c_ref_UBSH.copy_(c_now.expand_as(c_ref_UBSH))
            return
        # Refresh first, then measure (the authors' order): a unit computed at this step has a
        # cache as fresh as the local state, so its drift restarts from zero here.
        for u in range(self.units):
            if compute_U[u]:
                c_ref_UBSH[u].copy_(c_now)
        drift_U = torch.stack([drift(c_now, c_ref_UBSH[u]) for u in range(self.units)])
        alpha = self.alpha_NLU[n, layer] if self.cfg.use_alpha else None
        self.ase_NLU[n, layer] = ase(self.weights_NLU[n, layer], drift_U, alpha)
        anchor = self.c_anchor_NLBSH[n, layer]  # relative drift since the anchor (the gate), kept on device
        tiny = torch.finfo(torch.float32).tiny
        self.gate_NL[n, layer] = (c_now - anchor).norm() / anchor.norm().clamp_min(tiny)


class HpdcPlanner(StepPlanner):
    name = "hpdc"
    reuses_after_anchor = True  # the step right after an anchor reuses every remote unit (2.3)
    Statistics = HpdcStatistics

    def _prepare(self, step: int, scores_LU: torch.Tensor, gate: float) -> None:
        if self._epsilon is None:
            # first selective step of the anchor window: hold this threshold until the next anchor
            self._epsilon = float(torch.quantile(scores_LU.flatten(), self.cfg.cache_ratio))
        if step >= self.steps or self._is_exact(step):
            return  # cool-down (or end of run): exact, never an anchor
        gate_fired = float(gate) >= self.cfg.gate_factor * self.cfg.cache_ratio
        self._prepared = self._decide(step, scores_LU >= self._epsilon, self._epsilon, gate_fired)
