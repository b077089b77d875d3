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

Per layer the rank also measures what its planner needs (the planner's `Statistics`:
planner/hpdc.py, planner/budget.py). Per step the scores are averaged over branches,
all-reduced (mean) over the plan group so every rank plans identically, and handed to the
planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from planner.ditango import PLANNER_CLASSES, DiTangoPlanner, PlannerConfig, StepPlan, unit_offsets
from planner.layout import chunk_sizes, token_count
from planner.reuse import run_reuse_costs
from runtime.cache import (
    StateCache,
    anchor_bytes,
    auto_cache_limit,
    cache_dtype_for,
    compose_factor,
    unit_bytes,
)
from runtime.comm import Comm
from runtime.kernels import Backend
from runtime.mesh import Mesh
from runtime.state import AttentionState
from runtime.strategies.exact import EXACT, with_extra
from runtime.strategies.selective_layer import selective_layer


class SelectiveRuntime:
    """Per-rank DiTango state for one model: the planner and its statistics, the state cache,
    and the attention that fetches, merges and caches by the plan."""

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
        patch: tuple[int, int, int] = (1, 2, 2),
        element_bytes: int = 4,
    ) -> None:
        self.mesh, self.comm, self.backend = mesh, comm, backend
        self.element_bytes = element_bytes  # the transformer's dtype, as its K and V travel
        self.patch = patch  # the transformer's (frames, rows, columns) per token
        self.planner_cfg = planner_cfg
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.cache_dtype, self.cache_limit_bytes = cache_dtype, cache_limit_bytes
        self.group_size = mesh.layout.group  # I: adjacent cp ranks per group
        self.groups = mesh.layout.groups  # G: groups on the cp ring
        self.compose = 1  # k: adjacent remote groups per cached unit
        self.planner = None  # planner/hpdc.py or planner/budget.py, per item
        self.stats = None  # the planner's statistics, per item
        self.cache: StateCache | None = None
        self.step_plan: StepPlan | None = None
        self.branch = 0
        self.cache_peak_bytes = 0
        self.control_device = torch.device("cpu")
        # A step cache (runtime/step_cache.py) may skip whole layers on a step: then the layers
        # that ran are agreed at the end of each step, and the plan and the ages follow them.
        self.partial_steps = False
        # --reuse auto: the cost model's verdict on this item (planner/reuse.py), agreed by the plan
        # group; where reuse does not pay, every step is the exact ring (`exact_only`).
        self.reuse: dict | None = None

    # -- per item ------------------------------------------------------------------------
    @property
    def unit_list(self) -> list[tuple[int, ...]]:
        """Ring offsets of each decision unit (0: the own group's other members)."""
        return unit_offsets(self.groups, self.group_size, self.planner_cfg.own_group, self.compose)

    @property
    def units(self) -> int:
        return len(self.unit_list)

    @property
    def planner_class(self):
        return PLANNER_CLASSES[self.planner_cfg.planner]

    @property
    def own_unit(self) -> bool:
        """Whether unit 0 is the own group's other members (else the whole own group is local)."""
        return self.planner_cfg.own_group == "decide" and self.group_size > 1

    # -- the denoising loop's listener (runtime/denoiser.py) ------------------------------
    def begin_run(self, latents_BCFHW: torch.Tensor, steps: int, branches: int, switches: tuple[int, ...] = ()) -> None:
        """An item starts: its cache sized for the token chunks of `latents_BCFHW`. `switches`:
        the steps where another expert takes over (Wan2.2 A14B): cached states belong to the
        expert that made them, so such a step is an anchor."""
        tokens = token_count(tuple(latents_BCFHW.shape[2:]), self.patch)
        sizes = chunk_sizes(tokens, len(self.mesh.cp_ranks))
        self.reuse = self._reuse_check(tokens, latents_BCFHW.device)
        self.allocate(
            max(sizes),
            latents_BCFHW.shape[0],
            steps,
            branches,
            latents_BCFHW.device,
            local_tokens=sizes[self.mesh.cp_index],
            switches=switches,
        )

    @property
    def exact_only(self) -> bool:
        return self.reuse is not None and not self.reuse["pays"]

    def _reuse_check(self, tokens: int, device: torch.device) -> dict | None:
        """With --reuse auto, whether reuse saves more than its bookkeeping costs on this item
        (all ranks agree: a heterogeneous plan group takes the minimum); None: --reuse always."""
        if self.planner_cfg.reuse == "always":
            return None
        cache_bytes = (self.cache_dtype or cache_dtype_for(None, device)).itemsize
        layout, cfg = self.mesh.layout, self.planner_cfg
        costs = run_reuse_costs(device, layout, self.heads, self.head_dim, tokens, cfg, self.element_bytes, cache_bytes)
        return {**costs.to_json(), "pays": bool(self._agree_min(int(costs.pays)))}

    def allocate(
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
        self.control_device = device = torch.device("cpu") if device is None else torch.device(device)
        local_tokens = max_tokens if local_tokens is None else local_tokens
        dtype = self.cache_dtype or cache_dtype_for(None, device)
        limit = self.cache_limit_bytes
        if limit is None and device.type == "cuda":
            limit = self._agree_min(auto_cache_limit(device))
        statistics = self.planner_class.Statistics
        per_unit = unit_bytes(
            batch, max_tokens, self.heads, self.head_dim, dtype, reference=statistics.reference_states
        )
        fixed = branches * self.layers * (anchor_bytes(batch, max_tokens, self.heads) + int(self.own_unit) * per_unit)
        self.compose = compose_factor(self.groups - 1, branches, self.layers, per_unit, limit, fixed_bytes=fixed)
        self.branches = branches
        planner_cfg = replace(self.planner_cfg, warmup=steps, cooldown=0) if self.exact_only else self.planner_cfg
        self.planner = DiTangoPlanner(planner_cfg, steps, self.layers, self.units, switches)
        self.cache = StateCache(branches, self.layers, self.units, dtype)
        if not self.exact_only:  # nothing is cached when every step is exact
            self.cache.allocate(batch, local_tokens, self.heads, self.head_dim, device)
        # The planner's statistics, preallocated with the cache.
        self.stats = statistics(self.planner_cfg, branches, self.layers, self.units, self.planner.switches, device)
        self.stats.allocate(batch, local_tokens, self.heads)
        self.scores_LU = torch.zeros(self.layers, self.units)  # the last scores observed per layer (host)
        self.kv_fresh, self.evaluations = 0.0, 0  # fraction of the KV tokens computed, summed over evaluations
        self.cache_peak_bytes = self.cache.nbytes() + self.reference_bytes()
        self.ran_NL = torch.zeros(branches, self.layers, dtype=torch.bool)

    def end_run(self) -> None:
        """Free the item's buffers (the caller then returns the memory to the device)."""
        if self.cache is not None:
            self.cache.reset()
        self.stats = self.scores_LU = self.ran_NL = None  # planner statistics too

    def reference_bytes(self) -> int:
        """What the planner's statistics keep beside the cache (compressed local states)."""
        return 0 if self.stats is None else self.stats.nbytes()

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
        t = torch.tensor([value], dtype=torch.int64, device=self.control_device)
        self.comm.all_reduce(t, dist.ReduceOp.MIN, group, ranks)
        return int(t.item())

    def _layers_run(self) -> torch.Tensor:
        """The layers whose attention ran this step in every branch (all of them unless a step
        cache skipped some: then one all-reduce over the plan group agrees). A layer one branch
        skipped counts as not run: its cache there is older than a plan computing it assumes."""
        if not self.partial_steps:
            return torch.ones(self.layers, dtype=torch.bool)
        ran = self.ran_NL.all(0).to(self.control_device, torch.int32)
        group, ranks = self._plan_group()
        if group is not None:
            self.comm.all_reduce(ran, dist.ReduceOp.MIN, group, ranks)
        return ran.cpu().bool()

    def begin_step(self, step: int) -> None:
        assert self.planner is not None, "begin_run first"
        self.step_plan = self.planner.plan(step)
        if not self.exact_only:  # every step exact: nothing to disagree on
            self._check_plan_agrees(self.step_plan)
        self.stats.begin_step(self.step_plan)
        self.ran_NL.zero_()

    def _check_plan_agrees(self, plan: StepPlan) -> None:
        """Raise, before any exchange, when this step's plan differs between ranks: mismatched
        P2P exchanges would hang NCCL until its watchdog instead of failing. One all-reduce
        (max of the fingerprint and of its negation) of two integers per step."""
        group, ranks = self._plan_group()
        if group is None:
            return
        h = plan.fingerprint()
        t = torch.tensor([h, -h], dtype=torch.int64, device=self.control_device)
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
        ran_L = self._layers_run()
        self.planner.not_run(step, ~ran_L)
        as_planned = bool(ran_L.all())
        plan = plan if as_planned else self.planner.last_plan()
        self.stats.end_step(step, plan, as_planned)
        if not self.planner.observes(plan.kind):
            return
        # One vector for every rank (and branch): scores [L, U] then the gate scalar, averaged
        # over the plan group so that every rank plans the next step identically.
        stats = self.stats.scores(ran_L)
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
    def attend(self, ctx, q_BSHD, k_BSHD, v_BSHD, scale: float, layer: int = 0, extra_kv=None) -> torch.Tensor:
        """The strategy of `ctx` (a ShardContext): this step's plan, plus `extra_kv` fresh."""
        if self.exact_only:  # the exact ring over the cp group, as --parallel ring runs it
            self.ran_NL[self.branch, layer] = True
            self.kv_fresh, self.evaluations = self.kv_fresh + 1.0, self.evaluations + 1
            return EXACT.attend(ctx, q_BSHD, k_BSHD, v_BSHD, scale, layer, extra_kv)
        state = self.attention(layer, q_BSHD, k_BSHD, v_BSHD, scale, ctx.seq_sizes)
        return with_extra(state, q_BSHD, extra_kv, scale, self.backend).out_BSHD.to(q_BSHD.dtype)

    def attention(self, layer: int, q_BSHD, k_BSHD, v_BSHD, scale: float, seq_sizes: Sequence[int]) -> AttentionState:
        """Attention of the local queries over the whole sequence under this step's plan."""
        return selective_layer(self, layer, q_BSHD, k_BSHD, v_BSHD, scale, seq_sizes)

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
            "reuse": self.reuse,  # --reuse auto: the cost model's verdict (None: --reuse always)
            "compose_factor": self.compose,
            "units": self.units,
            "groups": self.groups,
            "group_size": self.group_size,
        }
