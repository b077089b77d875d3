"""DiTango selective attention: near KV fresh, far KV from cached attention states.

Shape legend: B batch, S local query tokens, K tokens of a KV block, H heads, D head
dim, N cfg branches, L layers, U units.

The cp ranks form G groups of I adjacent ranks. Every rank sees the same plan, indexed
by ring offset d (group g+d from its own group g), so exchanges are symmetric:
- offset 0, the rank's own group: always computed fresh, ring over the I members;
- offset d >= 1 (remote), when its unit is COMPUTE: rank r receives the KV chunk of
  cp rank r + I*d directly (and sends its own to r - I*d), then the I members pass those
  blocks around the group ring, so each rank sees all I chunks of group g+d. Every
  computed group is fetched from its owner at distance I*d, whatever was skipped before
  it, so no skip counter exists to get wrong (the authors' snapshot forgot to reset one
  and fetched the wrong block after a gap). The fetch of the next computed group is
  posted before the current one is computed;
- a REUSE unit is merged from the state cache: no bytes move.
Remote groups are cached in units of k adjacent groups (k = 1 unless the memory cap
forces composition; a composed unit's state is the exact merge of its groups').

Per layer the rank also measures what the planner needs (ALGORITHMS.md 2.3): the
compressed local state C = mean_D(out of own group), lse norms at anchors
(importance), drift of C since each unit's last refresh, and the relative drift since
the anchor (gate). Per step these are averaged over branches, all-reduced (mean) over
the cp group so every rank plans identically, and handed to the planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from planner.ditango import (
    DiTangoPlanner,
    PlannerConfig,
    StepPlan,
    alpha_factors,
    ase,
    compressed_state,
    drift,
    importance_weights,
)
from runtime.cache import StateCache, compose_factor, unit_bytes
from runtime.comm import Comm
from runtime.errors import ConfigError
from runtime.kernels import Backend, attention
from runtime.mesh import Mesh
from runtime.state import AttentionState, merge, merge_all
from runtime.strategies.ring import ring_attention


@dataclass(frozen=True)
class DiTangoOptions:
    """User intent for --parallel ditango beyond the planner: cache precision and memory cap."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    cache_dtype: str = "float32"  # float32 | bfloat16 (the `out` part; lse stays float32)
    cache_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.cache_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--cache-dtype must be float32 or bfloat16, got {self.cache_dtype!r}")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes <= 0:
            raise ConfigError(f"--cache-memory-limit must be > 0, got {self.cache_limit_bytes}")

    @property
    def torch_cache_dtype(self) -> torch.dtype:
        return torch.float32 if self.cache_dtype == "float32" else torch.bfloat16


class DiTangoRuntime:
    """Per-rank DiTango state for one model: planner, cache, anchor statistics."""

    def __init__(
        self,
        mesh: Mesh,
        comm: Comm,
        backend: Backend,
        planner_cfg: PlannerConfig,
        layers: int,
        heads: int,
        head_dim: int,
        cache_dtype: torch.dtype = torch.float32,
        cache_limit_bytes: int | None = None,
    ) -> None:
        self.mesh, self.comm, self.backend = mesh, comm, backend
        self.planner_cfg = planner_cfg
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.cache_dtype, self.cache_limit_bytes = cache_dtype, cache_limit_bytes
        self.I = mesh.layout.group
        self.G = mesh.layout.groups
        self.k = 1
        self.planner: DiTangoPlanner | None = None
        self.cache: StateCache | None = None
        self.step_plan: StepPlan | None = None
        self.branch = 0
        self.cache_peak_bytes = 0

    # -- per item ------------------------------------------------------------------------
    @property
    def units(self) -> int:
        return -(-(self.G - 1) // self.k)

    def unit_offsets(self, unit: int) -> range:
        return range(1 + unit * self.k, min(self.G, 1 + (unit + 1) * self.k))

    def begin_run(self, max_tokens: int, batch: int, steps: int, branches: int, device=None) -> None:
        """`max_tokens`: the LARGEST local chunk of any rank, so every rank picks the same
        compose factor (and so the same units and plan) even when chunks are uneven."""
        per_unit = unit_bytes(batch, max_tokens, self.heads, self.head_dim, self.cache_dtype)
        self.k = compose_factor(self.G - 1, branches, self.layers, per_unit, self.cache_limit_bytes)
        self.branches = branches
        self.planner = DiTangoPlanner(self.planner_cfg, steps, self.layers, self.units)
        self.cache = StateCache(branches, self.layers, self.units, self.cache_dtype)
        self._device = device or torch.device("cpu")
        U, L, N = self.units, self.layers, branches
        # Planner statistics stay on the compute device; the host sees them once per step.
        self.weights_NLU = torch.zeros(N, L, U, device=self._device)
        self.alpha_NLU = torch.ones(N, L, U, device=self._device)
        self.c_anchor: dict[tuple[int, int], torch.Tensor] = {}
        self.c_ref: dict[tuple[int, int, int], torch.Tensor] = {}
        self.cache_peak_bytes = 0
        self._reset_step_stats()

    def reference_bytes(self) -> int:
        """Compressed local states kept for the drift estimate (per branch, layer, unit + anchors)."""
        return sum(t.nbytes for t in self.c_ref.values()) + sum(t.nbytes for t in self.c_anchor.values())

    def _reset_step_stats(self) -> None:
        self.ase_NLU = torch.zeros(self.branches, self.layers, self.units, device=self._device)
        self.gate_NL = torch.zeros(self.branches, self.layers, device=self._device)

    def begin_step(self, step: int) -> None:
        assert self.planner is not None, "begin_run first"
        self.step_plan = self.planner.plan(step)
        self._reset_step_stats()

    def begin_branch(self, branch: int) -> None:
        self.branch = branch

    def end_step(self, step: int) -> None:
        plan = self.step_plan
        assert plan is not None
        if self.cache is not None:
            self.cache_peak_bytes = max(self.cache_peak_bytes, self.cache.peak_bytes + self.reference_bytes())
        if plan.kind != "selective":
            return
        # One vector for every rank (and branch): ASE [L, U] then the gate scalar.
        stats = torch.cat([self.ase_NLU.mean(0).flatten(), self.gate_NL.mean().reshape(1)])
        # With CFG branches on different ranks the whole world averages, so both branches
        # follow one plan (as the authors do); otherwise the cp group.
        if self.mesh.layout.cfg_degree > 1:
            group, size = self.mesh.world_group, self.mesh.world_size
        else:
            group, size = self.mesh.cp_group, len(self.mesh.cp_ranks)
        if group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
            stats = stats / size
        stats = stats.cpu()  # the one host sync of the step
        self.planner.observe(step, stats[:-1].reshape(self.layers, self.units), float(stats[-1]))

    # -- per layer -----------------------------------------------------------------------
    def attention(self, layer: int, q_BSHD, k_BSHD, v_BSHD, scale: float, seq_sizes: Sequence[int]) -> AttentionState:
        """Attention of the local queries over the whole sequence under this step's plan."""
        plan = self.step_plan
        assert plan is not None and self.cache is not None
        self._device = q_BSHD.device
        mesh = self.mesh
        cp = len(mesh.cp_ranks)
        c = mesh.cp_index
        g, i = divmod(c, self.I)

        def group_sizes(group: int) -> list[int]:
            return [seq_sizes[(group % self.G) * self.I + j] for j in range(self.I)]

        def group_state(qk, kk, vv, group: int) -> AttentionState:
            if self.I == 1:
                return attention(qk, kk, vv, scale, self.backend)
            return ring_attention(
                qk, kk, vv, scale=scale, backend=self.backend, comm=self.comm,
                ring_ranks=mesh.group_ranks, ring_group=mesh.group_group, kv_sizes=group_sizes(group),
            )  # fmt: skip

        if plan.kind == "selective":
            compute_U = plan.compute_LU[layer].tolist()
        else:
            compute_U = [True] * self.units
        offsets = [d for u in range(self.units) if compute_U[u] for d in self.unit_offsets(u)]

        kv_2BKHD = torch.stack([k_BSHD, v_BSHD])
        B, _, H, D = k_BSHD.shape

        def fetch(d: int):
            # Symmetric: every rank sends its own chunk back by I*d and receives from I*d ahead.
            src_index = (c + self.I * d) % cp
            return self.comm.exchange(
                kv_2BKHD,
                dst=mesh.cp_ranks[(c - self.I * d) % cp],
                src=mesh.cp_ranks[src_index],
                recv_shape=(2, B, seq_sizes[src_index], H, D),
                group=mesh.cp_group,
            )

        fresh: dict[int, AttentionState] = {}
        pending = fetch(offsets[0]) if offsets else None  # in flight while the own group computes
        local = group_state(q_BSHD, k_BSHD, v_BSHD, g)
        for n, d in enumerate(offsets):
            block = pending.wait()
            pending = fetch(offsets[n + 1]) if n + 1 < len(offsets) else None  # prefetch
            fresh[d] = group_state(q_BSHD, block[0], block[1], g + d)

        unit_states: list[AttentionState] = []
        for u in range(self.units):
            if compute_U[u]:
                state = merge_all([fresh[d] for d in self.unit_offsets(u)])
                if plan.kind != "exact":
                    self.cache.put(self.branch, layer, u, state)
            else:
                state = self.cache.get(self.branch, layer, u)
            unit_states.append(state)
        if plan.kind != "exact":
            self._measure(layer, plan.kind, local, unit_states, compute_U)
        out = local
        for state in unit_states:
            out = merge(out, state)
        return out

    def _measure(self, layer: int, kind: str, local: AttentionState, units: list, compute_U: list[bool]) -> None:
        n = self.branch
        c_now = compressed_state(local.out_BSHD)
        if kind == "anchor":
            norms = torch.stack([s.lse_BSH.norm() for s in units] + [local.lse_BSH.norm()])
            self.weights_NLU[n, layer] = importance_weights(norms)[:-1]
            if self.planner_cfg.use_alpha:
                out_norms = torch.stack([s.out_BSHD.norm() for s in units])
                self.alpha_NLU[n, layer] = alpha_factors(out_norms, local.out_BSHD.norm())
            self.c_anchor[n, layer] = c_now
            for u in range(self.units):
                self.c_ref[n, layer, u] = c_now
            return
        # Refresh first, then measure (the authors' order): a unit computed at this step has a
        # cache as fresh as the local state, so its drift restarts from zero here.
        for u in range(self.units):
            if compute_U[u]:
                self.c_ref[n, layer, u] = c_now
        drift_U = torch.stack([drift(c_now, self.c_ref[n, layer, u]) for u in range(self.units)])
        alpha = self.alpha_NLU[n, layer] if self.planner_cfg.use_alpha else None
        self.ase_NLU[n, layer] = ase(self.weights_NLU[n, layer], drift_U, alpha)
        anchor = self.c_anchor[n, layer]  # relative drift since the anchor (the gate), kept on device
        self.gate_NL[n, layer] = (c_now - anchor).norm() / anchor.norm().clamp_min(torch.finfo(torch.float32).tiny)

    def item_report(self) -> dict:
        assert self.planner is not None
        log = self.planner.log()
        summary = log.summary()
        return {
            "plan_log": log.to_json(),
            "computed_fraction": summary["computed_fraction"],
            "per_step": summary["per_step"],
            "plan": summary,
            "plan_hash": log.hash(),
            "cache_peak_bytes": self.cache_peak_bytes,
            "compose_factor": self.k,
            "units": self.units,
            "groups": self.G,
            "group_size": self.I,
        }
