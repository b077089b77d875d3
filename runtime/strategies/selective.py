"""DiTango selective attention: near KV fresh, far KV from cached attention states.

Shape legend: B batch, S local query tokens, K tokens of a KV block, H heads, D head
dim, N cfg branches, L layers, U units.

The cp ranks form G groups of I adjacent ranks. Every rank sees the same plan, indexed
by ring offset d (group g+d from its own group g), so exchanges are symmetric:
- the rank's own KV chunk: always computed fresh ("local");
- offset 0, the other I-1 members of its own group: one decision unit (own_group
  "decide", the authors' behaviour), computed by a ring over the group when its unit is
  COMPUTE; with own_group "fresh" the whole own group is local, computed every step;
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
compressed local state C = mean_D(local out), lse norms at anchors (importance), drift
of C since each unit's last refresh, and the relative drift since the anchor (gate). The
budget planner instead measures each recomputed cell's error rate (the mass-weighted
change of its state against the cached one, relative to the layer's output, per step of
age) and scores every cell by rate x the age it would have next step; a cell not measured
yet takes its softmax mass x the local relative drift of one step. Per step the scores
are averaged over branches, all-reduced (mean) over the cp group so every rank plans
identically, and handed to the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from planner.ditango import (
    DiTangoOptions,
    DiTangoPlanner,
    PlannerConfig,
    StepPlan,
    alpha_factors,
    ase,
    budget_scores,
    compressed_state,
    drift,
    importance_weights,
    softmax_mass,
    unit_offsets,
)
from planner.layout import chunk_sizes
from runtime.cache import StateCache, anchor_bytes, compose_factor, unit_bytes
from runtime.comm import Comm
from runtime.kernels import Backend, attention
from runtime.mesh import Mesh
from runtime.state import AttentionState, merge, merge_all
from runtime.strategies.ring import ring_attention

CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # DiTangoOptions.cache_dtype names
# Without --cache-memory-limit on a GPU, the cache may take the free memory minus this much,
# left for activations, the KV blocks in flight and the allocator's fragmentation.
AUTO_LIMIT_HEADROOM_FRACTION = 0.10  # of the GPU's total memory
AUTO_LIMIT_HEADROOM_MIN = 4 * 2**30


def cache_dtype_for(name: str | None, device: torch.device) -> torch.dtype:
    """`name` None: bfloat16 on CUDA (where memory decides what fits), float32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return CACHE_DTYPES[name]


def check_cache_limit(
    opts: DiTangoOptions, items, layout, heads: int, head_dim: int, layers: int, device: torch.device
) -> None:
    """Raise now (before any rank starts) when a user's cache limit cannot hold one cached unit
    per branch and layer of some item: the same sizing `SelectiveRuntime.begin_run` does."""
    if opts.cache_limit_bytes is None:
        return
    dtype = cache_dtype_for(opts.cache_dtype, device)
    for item in items:
        tokens = max(chunk_sizes(item.tokens(), layout.cp_degree))
        branches = 1 if layout.cfg_degree == 2 or item.cfg_scale <= 1 else 2
        per_unit = unit_bytes(1, tokens, heads, head_dim, dtype, reference=opts.planner.planner != "budget")
        own = len(unit_offsets(layout.groups, layout.group, opts.planner.own_group)) - (layout.groups - 1)
        fixed = branches * layers * (anchor_bytes(1, tokens, heads) + own * per_unit)
        compose_factor(layout.groups - 1, branches, layers, per_unit, opts.cache_limit_bytes, fixed)


def auto_cache_limit(device: torch.device) -> int | None:
    """This GPU's budget for the cache when the user set none: free memory (counting what the
    allocator holds unused) minus the headroom. None on CPU (no cap)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    headroom = max(AUTO_LIMIT_HEADROOM_MIN, int(AUTO_LIMIT_HEADROOM_FRACTION * total))
    return max(1, free - headroom)


class SelectiveRuntime:
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
        cache_dtype: torch.dtype | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        self.mesh, self.comm, self.backend = mesh, comm, backend
        self.planner_cfg = planner_cfg
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.cache_dtype, self.cache_limit_bytes = cache_dtype, cache_limit_bytes
        self.group_size = mesh.layout.group  # I: adjacent cp ranks per group
        self.groups = mesh.layout.groups  # G: groups on the cp ring
        self.compose = 1  # k: adjacent remote groups per cached unit
        self.planner: DiTangoPlanner | None = None
        self.cache: StateCache | None = None
        self.step_plan: StepPlan | None = None
        self.branch = 0
        self.cache_peak_bytes = 0
        self._device = torch.device("cpu")
        self.c_ref_NLUBSH: torch.Tensor | None = None  # [N, L, U, B, S, H] float32
        self.c_anchor_NLBSH: torch.Tensor | None = None  # [N, L, B, S, H] float32
        # A step cache (runtime/step_cache.py) may skip whole layers on a step: then the layers
        # that ran are agreed at the end of each step, and the plan and the ages follow them.
        self.partial_steps = False

    # -- per item ------------------------------------------------------------------------
    @property
    def unit_list(self) -> list[tuple[int, ...]]:
        """Ring offsets of each decision unit (0: the own group's other members)."""
        return unit_offsets(self.groups, self.group_size, self.planner_cfg.own_group, self.compose)

    @property
    def units(self) -> int:
        return len(self.unit_list)

    @property
    def budget(self) -> bool:
        return self.planner_cfg.planner == "budget"

    @property
    def own_unit(self) -> bool:
        """Whether unit 0 is the own group's other members (else the whole own group is local)."""
        return self.planner_cfg.own_group == "decide" and self.group_size > 1

    def begin_run(
        self,
        max_tokens: int,
        batch: int,
        steps: int,
        branches: int,
        device=None,
        local_tokens: int | None = None,
        switches: tuple[int, ...] = (),
    ) -> None:
        """Size and allocate the item's cache before its first step.

        `max_tokens`: the LARGEST local chunk of any rank, so every rank picks the same
        compose factor (and so the same units and plan) even when chunks are uneven;
        `local_tokens`: this rank's chunk (the buffers' S; default `max_tokens`); `switches`:
        steps where another expert takes over (anchors: nothing cached crosses one). Without a
        user cap on CUDA the cap is the free memory, agreed (minimum) over the plan group."""
        self._device = device = torch.device("cpu") if device is None else torch.device(device)
        local_tokens = max_tokens if local_tokens is None else local_tokens
        dtype = self.cache_dtype or cache_dtype_for(None, device)
        limit = self.cache_limit_bytes
        if limit is None and device.type == "cuda":
            limit = self._agree_min(auto_cache_limit(device))
        per_unit = unit_bytes(batch, max_tokens, self.heads, self.head_dim, dtype, reference=not self.budget)
        fixed = branches * self.layers * (anchor_bytes(batch, max_tokens, self.heads) + int(self.own_unit) * per_unit)
        self.compose = compose_factor(self.groups - 1, branches, self.layers, per_unit, limit, fixed_bytes=fixed)
        self.branches = branches
        self.planner = DiTangoPlanner(self.planner_cfg, steps, self.layers, self.units, switches)
        U, L, N = self.units, self.layers, branches
        self.cache = StateCache(N, L, U, dtype)
        self.cache.allocate(batch, local_tokens, self.heads, self.head_dim, device)
        # Compressed local states C [B, S, H], preallocated with the cache. The hpdc planner's
        # drift estimate: the reference of each unit (its last refresh) and of each layer's
        # anchor; the budget planner's proxy for a rate not measured yet: the previous step's.
        self.c_ref_NLUBSH = self.c_anchor_NLBSH = self.c_prev_NLBSH = None
        if self.budget:
            self.c_prev_NLBSH = torch.zeros(N, L, batch, local_tokens, self.heads, device=device)
        else:
            self.c_ref_NLUBSH = torch.zeros(N, L, U, batch, local_tokens, self.heads, device=device)
            self.c_anchor_NLBSH = torch.zeros(N, L, batch, local_tokens, self.heads, device=device)
        # The budget planner's error rate of each cell (relative output error per step of age,
        # measured when the cell is recomputed; < 0: not measured yet) and the step each cell's
        # cache was last refreshed (replicated: the plans are).
        self.rate_NLU = torch.full((N, L, U), -1.0, device=device)
        self.refreshed_LU = torch.full((L, U), -1, dtype=torch.long)
        # The same on the device, with this step's compute bits there: the budget scores of every
        # layer read them (a host tensor copied per layer stalls the GPU stream each time).
        self.refreshed_dev_LU = torch.full((L, U), -1, dtype=torch.long, device=device)
        self.compute_dev_LU = None
        self._steps_done = 0
        # Planner statistics stay on the compute device; the host sees them once per step.
        self.weights_NLU = torch.zeros(N, L, U, device=device)
        self.alpha_NLU = torch.ones(N, L, U, device=device)
        self.scores_LU = torch.zeros(L, U)  # the last scores observed per layer (host)
        self.kv_fresh, self.evaluations = 0.0, 0  # fraction of the KV tokens computed, summed over evaluations
        self.cache_peak_bytes = self.cache.nbytes() + self.reference_bytes()
        self._reset_step_stats()

    def end_run(self) -> None:
        """Free the item's buffers (the caller then returns the memory to the device)."""
        if self.cache is not None:
            self.cache.reset()
        self.c_ref_NLUBSH = self.c_anchor_NLBSH = self.c_prev_NLBSH = None
        self.weights_NLU = self.alpha_NLU = self.ase_NLU = self.gate_NL = None  # planner statistics too
        self.rate_NLU = self.refreshed_LU = self.scores_LU = self.ran_NL = None
        self.refreshed_dev_LU = self.compute_dev_LU = None

    def reference_bytes(self) -> int:
        """Compressed local states kept for the drift estimate (per branch, layer, unit + anchors)."""
        return sum(t.nbytes for t in (self.c_ref_NLUBSH, self.c_anchor_NLBSH, self.c_prev_NLBSH) if t is not None)

    def _plan_group(self):
        """Who must follow one plan: the whole world when CFG branches run on different ranks
        (as the authors do), else the cp group. (group, global ranks); group None on one rank."""
        if self.mesh.layout.cfg_degree > 1:
            return self.mesh.world_group, tuple(range(self.mesh.world_size))
        return self.mesh.cp_group, self.mesh.cp_ranks

    def _agree_min(self, value: int) -> int:
        group, ranks = self._plan_group()
        if group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        self.comm.all_reduce(t, dist.ReduceOp.MIN, group, ranks)
        return int(t.item())

    def _reset_step_stats(self) -> None:
        self.ase_NLU = torch.zeros(self.branches, self.layers, self.units, device=self._device)
        self.gate_NL = torch.zeros(self.branches, self.layers, device=self._device)
        self.ran_NL = torch.zeros(self.branches, self.layers, dtype=torch.bool)

    def _layers_run(self) -> torch.Tensor:
        """The layers whose attention ran this step in every branch (all of them unless a step
        cache skipped some: then one all-reduce over the plan group agrees). A layer one branch
        skipped counts as not run: its cache there is older than a plan computing it assumes."""
        if not self.partial_steps:
            return torch.ones(self.layers, dtype=torch.bool)
        ran = self.ran_NL.all(0).to(self._device, torch.int32)
        group, ranks = self._plan_group()
        if group is not None:
            self.comm.all_reduce(ran, dist.ReduceOp.MIN, group, ranks)
        return ran.cpu().bool()

    def begin_step(self, step: int) -> None:
        assert self.planner is not None, "begin_run first"
        self.step_plan = self.planner.plan(step)
        self._check_plan_agrees(self.step_plan)
        self._reset_step_stats()
        if self.budget:
            self.compute_dev_LU = self.step_plan.compute_LU.to(self._device)  # once a step
            if step in self.planner.switches:
                self.rate_NLU.fill_(-1.0)  # the cached states are the other expert's: no rate to measure

    def _check_plan_agrees(self, plan: StepPlan) -> None:
        """Raise, before any exchange, when this step's plan differs between ranks: mismatched
        P2P exchanges would hang NCCL until its watchdog instead of failing. One all-reduce
        (max of the fingerprint and of its negation) of two integers per step."""
        group, ranks = self._plan_group()
        if group is None:
            return
        h = plan.fingerprint()
        t = torch.tensor([h, -h], dtype=torch.int64, device=self._device)
        self.comm.all_reduce(t, dist.ReduceOp.MAX, group, ranks)
        high, low = int(t[0]), -int(t[1])
        if high != low:
            raise RuntimeError(
                f"DiTango plans differ across ranks at step {plan.step} (this rank: {plan!r}, fingerprint {h}; "
                f"range {low}..{high}): the KV exchanges would not pair up"
            )

    def begin_branch(self, branch: int) -> None:
        self.branch = branch

    def end_step(self, step: int) -> None:
        plan = self.step_plan
        assert plan is not None
        if self.cache is not None:
            self.cache_peak_bytes = max(self.cache_peak_bytes, self.cache.peak_bytes + self.reference_bytes())
        self._steps_done += 1
        ran_L = self._layers_run()
        self.planner.not_run(step, ~ran_L)
        plan = self.planner.last_plan() if not bool(ran_L.all()) else plan
        if self.budget:
            self.refreshed_LU[plan.compute_LU] = step  # exact steps refresh the cache too (below)
            done_LU = self.compute_dev_LU if plan is self.step_plan else plan.compute_LU.to(self._device)
            self.refreshed_dev_LU.masked_fill_(done_LU, step)
        if not self.planner.observes(plan.kind):
            return
        # One vector for every rank (and branch): scores [L, U] then the gate scalar, averaged
        # over the plan group so that every rank plans the next step identically.
        gate = self.gate_NL[:, ran_L.to(self.gate_NL.device)].mean() if bool(ran_L.any()) else self.gate_NL.sum()
        stats = torch.cat([self.ase_NLU.mean(0).flatten(), gate.reshape(1)])
        group, ranks = self._plan_group()
        if group is not None:
            self.comm.all_reduce(stats, dist.ReduceOp.SUM, group, ranks)
            stats = stats / len(ranks)
        stats = stats.cpu()  # the one host sync of the step
        scores_LU = stats[:-1].reshape(self.layers, self.units)
        scores_LU[~ran_L] = self.scores_LU[~ran_L]  # a layer that did not run keeps its last scores
        self.scores_LU = scores_LU
        self.planner.observe(step, scores_LU, float(stats[-1]))

    # -- per layer -----------------------------------------------------------------------
    def attention(self, layer: int, q_BSHD, k_BSHD, v_BSHD, scale: float, seq_sizes: Sequence[int]) -> AttentionState:
        """Attention of the local queries over the whole sequence under this step's plan."""
        plan = self.step_plan
        assert plan is not None and self.cache is not None
        self._device = q_BSHD.device
        mesh = self.mesh
        cp = len(mesh.cp_ranks)
        c = mesh.cp_index
        g, i = divmod(c, self.group_size)

        def group_sizes(group: int) -> list[int]:
            return [seq_sizes[(group % self.groups) * self.group_size + j] for j in range(self.group_size)]

        def group_state(qk, kk, vv, group: int, include_own: bool = True) -> AttentionState:
            if self.group_size == 1:
                return attention(qk, kk, vv, scale, self.backend)
            return ring_attention(
                qk, kk, vv, scale=scale, backend=self.backend, comm=self.comm, ring_ranks=mesh.near_ranks,
                ring_group=mesh.near_group, kv_sizes=group_sizes(group), include_own=include_own,
            )  # fmt: skip

        units = self.unit_list
        compute_U = plan.compute_LU[layer].tolist() if plan.kind == "selective" else [True] * len(units)
        offsets = [d for u, offs in enumerate(units) if compute_U[u] for d in offs if d > 0]
        self.ran_NL[self.branch, layer] = True
        own_computed = not self.own_unit or compute_U[0]  # the own group whole, or the own chunk only
        fresh_groups = {(g + d) % self.groups for d in offsets} | ({g} if own_computed else set())
        fresh_tokens = sum(sum(group_sizes(x)) for x in fresh_groups) + (0 if own_computed else seq_sizes[c])
        self.kv_fresh += fresh_tokens / sum(seq_sizes)
        self.evaluations += 1

        kv_2BKHD = torch.stack([k_BSHD, v_BSHD])
        B, _, H, D = k_BSHD.shape

        def fetch(d: int):
            # Symmetric: every rank sends its own chunk back by I*d and receives from I*d ahead.
            src_index = (c + self.group_size * d) % cp
            return self.comm.exchange(
                kv_2BKHD,
                dst=mesh.cp_ranks[(c - self.group_size * d) % cp],
                src=mesh.cp_ranks[src_index],
                recv_shape=(2, B, seq_sizes[src_index], H, D),
                group=mesh.cp_group,
            )

        fresh: dict[int, AttentionState] = {}
        # A fetch (cp communicator) is in flight while the group ring (group communicator) runs:
        # two communicators used at once, which NCCL allows when every rank issues their
        # operations in the same order. Here every rank posts the fetch first, then its group
        # ring, at every offset; both communicators exist since the mesh's warm-up.
        pending = fetch(offsets[0]) if offsets else None  # in flight while the own group computes
        if self.own_unit:
            local = attention(q_BSHD, k_BSHD, v_BSHD, scale, self.backend)  # the own chunk
            if compute_U[0]:
                fresh[0] = group_state(q_BSHD, k_BSHD, v_BSHD, g, include_own=False)
        else:
            local = group_state(q_BSHD, k_BSHD, v_BSHD, g)
        for n, d in enumerate(offsets):
            block = pending.wait()
            pending = fetch(offsets[n + 1]) if n + 1 < len(offsets) else None  # prefetch
            fresh[d] = group_state(q_BSHD, block[0], block[1], g + d)

        unit_states = [
            merge_all([fresh[d] for d in offs]) if compute_U[u] else self.cache.get(self.branch, layer, u)
            for u, offs in enumerate(units)
        ]
        out = local
        for state in unit_states:
            out = merge(out, state)
        if self.budget:
            self._measure_rates(layer, plan, unit_states, compute_U, out)
        # The budget planner keeps exact steps' states as well: the anchor after the warm-up
        # then measures every cell's rate against the step before it.
        if plan.kind != "exact" or self.budget:
            for u in range(len(units)):
                if compute_U[u]:
                    self.cache.put(self.branch, layer, u, unit_states[u])
        self._measure(layer, plan.kind, local, unit_states, compute_U, out)
        return out

    def _measure_rates(self, layer: int, plan: StepPlan, units: list, compute_U: list[bool], total) -> None:
        """Each recomputed cell's error had its cached state been reused: mass-weighted output
        change (first order, ALGORITHMS.md 1) relative to the layer's output, per step of age."""
        n = self.branch
        if plan.step in self.planner.switches:
            return
        total_norm = total.out_BSHD.norm().clamp_min(torch.finfo(torch.float32).tiny)
        for u, state in enumerate(units):
            age = plan.step - int(self.refreshed_LU[layer, u])
            if not compute_U[u] or age < 1 or self.refreshed_LU[layer, u] < 0:
                continue
            old = self.cache.get(n, layer, u)
            weight_BSH1 = torch.exp(state.lse_BSH - total.lse_BSH).unsqueeze(-1)
            error = (weight_BSH1 * (state.out_BSHD - old.out_BSHD)).norm() / total_norm
            self.rate_NLU[n, layer, u] = error / age

    def _measure(
        self, layer: int, kind: str, local: AttentionState, units: list, compute_U: list[bool], total: AttentionState
    ) -> None:
        n = self.branch
        budget = self.budget
        if kind == "exact" and not budget:
            return
        c_now = compressed_state(local.out_BSHD)
        tiny = torch.finfo(torch.float32).tiny
        if budget:  # one step's relative drift, then this step's C becomes the previous one
            prev = self.c_prev_NLBSH[n, layer]
            c_norm = c_now.norm().clamp_min(tiny)
            step_drift = (c_now - prev).norm() / c_norm if self._steps_done else torch.zeros((), device=c_now.device)
            prev.copy_(c_now)
            mass_U = torch.stack([softmax_mass(s.lse_BSH, total.lse_BSH) for s in units])
            self.ase_NLU[n, layer] = self._budget_scores(layer, mass_U, step_drift)
            return
        c_ref_UBSH = self.c_ref_NLUBSH[n, layer]
        if kind == "anchor":
            norms = torch.stack([s.lse_BSH.norm() for s in units] + [local.lse_BSH.norm()])
            self.weights_NLU[n, layer] = importance_weights(norms)[:-1]
            if self.planner_cfg.use_alpha:
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
        alpha = self.alpha_NLU[n, layer] if self.planner_cfg.use_alpha else None
        self.ase_NLU[n, layer] = ase(self.weights_NLU[n, layer], drift_U, alpha)
        anchor = self.c_anchor_NLBSH[n, layer]  # relative drift since the anchor (the gate), kept on device
        self.gate_NL[n, layer] = (c_now - anchor).norm() / anchor.norm().clamp_min(tiny)

    def _budget_scores(self, layer: int, mass_U, step_drift):
        """Predicted error of each cell if reused at the next step: its rate times its age then
        (1 for a cell computed now); a cell whose rate is not measured yet takes its mass times
        the local relative drift of one step."""
        rate_U = self.rate_NLU[self.branch, layer]
        rate_U = torch.where(rate_U >= 0, rate_U, mass_U * step_drift)
        # On the device (no host tensor per layer): 1 for a cell computed now (every cell of an
        # exact or anchor step), else since its refresh.
        age_U = torch.where(self.compute_dev_LU[layer], 1, self.step_plan.step + 1 - self.refreshed_dev_LU[layer])
        return budget_scores(rate_U, age_U)

    def item_report(self) -> dict:
        assert self.planner is not None
        log = self.planner.log()
        summary = log.summary()
        # Steps where the second expert took over: anchors by construction (planner/ditango.py).
        summary["expert_switches"] = list(self.planner.switches)
        return {
            "plan_log": {
                **log.to_json(),
                "expert_switches": list(self.planner.switches),
                "unit_offsets": self.unit_list,
            },
            "planner": self.planner_cfg.planner,
            "cache_ratio": self.planner_cfg.cache_ratio,
            "own_group": self.planner_cfg.own_group if self.group_size > 1 else None,
            "unit_offsets": [list(offs) for offs in self.unit_list],
            "computed_fraction_all_steps": summary["computed_fraction_all_steps"],
            "computed_fraction_selective": summary["computed_fraction_selective"],
            "steps": summary["steps"],
            "per_step": summary["per_step"],
            "plan": summary,
            "plan_hash": log.hash(),
            # Over the self-attention evaluations that ran: the fraction of the KV tokens computed
            # fresh (the own chunk, and the groups of the units computed)
            "kv_fraction_per_evaluation": round(self.kv_fresh / self.evaluations, 6) if self.evaluations else None,
            "cache_peak_bytes": self.cache_peak_bytes,
            "compose_factor": self.compose,
            "units": self.units,
            "groups": self.groups,
            "group_size": self.group_size,
        }
