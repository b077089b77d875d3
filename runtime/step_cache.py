"""Step caches: diffusers' cache hooks (first-block, PAB, TaylorSeer, MagCache) under every
strategy, with every decision to skip agreed by the ranks that compute the same branch.

Shape legend: B batch, S tokens (the rank's chunk under context parallelism), C channels.

A step cache skips work across denoising steps: the blocks after the first (first-block,
MagCache: the cached residual of the skipped blocks is added instead) or attention layers
(PAB: the attention output of an earlier step; TaylorSeer: a Taylor extrapolation of it).
diffusers' hooks do the work (`transformer.enable_cache`, one cache context per CFG
branch). What this module adds:
- Agreement. Under context parallelism each rank sees its own chunk, so a decision computed
  from activations would differ between ranks: some would run the blocks (and their
  attention exchanges) while others skip them, and the exchanges would not pair up. The two
  data-dependent decisions are agreed before they are taken, with one all-reduce over the
  ranks that compute the branch (the cp group): first-block's relative change of the first
  block's residual is a ratio of two sums, all-reduced (the whole sequence's ratio, as one
  process computes it); MagCache's calibration ratio is a mean over tokens (sum and count
  all-reduced). PAB and TaylorSeer decide from the step index alone, and MagCache from its
  fixed ratios: the same on every rank. Each CFG branch keeps its own cache context and
  decides on its own, as in diffusers (under --cfg-parallel each branch's group decides as
  one process would).
- Counting. Every forward records the blocks and self-attention layers it evaluated (probe
  hooks on a module that only runs when the block, or the attention, computes). The item's
  record holds the per-step counts, the steps whose blocks were skipped, and the fractions.
- MagCache's ratios. diffusers needs them per checkpoint: `mag_ratios=FILE` (a JSON list),
  or none: the first item is denoised once in calibration mode (it never skips: it is the
  exact run) and the measured ratios serve the batch (recorded in the report).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime.step_cache_options import StepCacheSpec, load_mag_ratios

# TaylorSeer extrapolates the outputs of these modules (re.fullmatch on their names): each
# block's attentions and FFN, in Wan and in HunyuanVideo (diffusers' default patterns miss
# Wan's `attn1`/`attn2`).
TAYLORSEER_MODULES = [r"blocks\.\d+\.(attn1|attn2|ffn)", r"(single_)?transformer_blocks\.\d+\.(attn|ff)"]


@dataclass
class _Forward:
    step: int
    branch: str
    blocks: int = 0
    attention: int = 0
    block_ids: set = field(default_factory=set)
    attention_ids: set = field(default_factory=set)


@dataclass
class StepCache:
    """Per-rank runtime of one `--step-cache`: installs diffusers' hooks on every expert for a
    run, agrees their decisions over `group` (the ranks computing the same branch; None on
    one rank) and counts what each forward evaluated."""

    spec: StepCacheSpec
    comm: object = None  # runtime.comm.Comm
    group: object = None
    ranks: tuple[int, ...] = ()
    mag_ratios: list[float] | None = None
    calibrating: bool = False
    forwards: list[_Forward] = field(default_factory=list)
    _installed: list = field(default_factory=list)
    _handles: list = field(default_factory=list)
    _now: _Forward | None = None
    _calibrated: dict = field(default_factory=dict)  # branch -> measured ratios (calibration mode)
    _hooks: dict = field(default_factory=dict)  # id(transformer) -> the cache's stateful hooks on it
    _pab_states: dict = field(default_factory=dict)  # (id(hook), branch) -> its PAB state
    timestep: float = 0.0
    step: int = 0

    def __post_init__(self) -> None:
        path = self.spec.settings.get("mag_ratios")
        if self.spec.name == "magcache" and path is not None and self.mag_ratios is None:
            self.mag_ratios = load_mag_ratios(path)

    def __repr__(self) -> str:
        return f"StepCache({self.spec.name}, {self.spec.settings}, forwards={len(self.forwards)})"

    @property
    def needs_calibration(self) -> bool:
        return self.spec.name == "magcache" and self.mag_ratios is None

    # -- per run -------------------------------------------------------------------------
    def config(self, steps: int):
        """The diffusers config of this cache for a run of `steps` steps."""
        from diffusers.hooks import (
            FirstBlockCacheConfig,
            MagCacheConfig,
            PyramidAttentionBroadcastConfig,
            TaylorSeerCacheConfig,
        )

        opts = {k: v for k, v in self.spec.settings.items() if k != "mag_ratios"}
        if self.spec.name == "first-block":
            return FirstBlockCacheConfig(**opts)
        if self.spec.name == "pab":
            return PyramidAttentionBroadcastConfig(**opts, current_timestep_callback=lambda: self.timestep)
        if self.spec.name == "taylorseer":
            if "taylor_factors_dtype" in opts:
                opts["taylor_factors_dtype"] = getattr(torch, opts["taylor_factors_dtype"])
            return TaylorSeerCacheConfig(**opts, cache_identifiers=TAYLORSEER_MODULES)
        if self.calibrating:
            return MagCacheConfig(**opts, num_inference_steps=steps, calibrate=True)
        return MagCacheConfig(**opts, num_inference_steps=steps, mag_ratios=list(self.mag_ratios))

    def begin_run(self, transformers, adapter, steps: int) -> None:
        """Install the cache on every expert (fresh states for the item) and the probes."""
        self.forwards, self._pab_states = [], {}
        for transformer in transformers:
            transformer.enable_cache(self.config(steps))
            self._installed.append(transformer)
            self._agree(transformer, adapter)
            self._hooks[id(transformer)] = [
                hook
                for m in transformer.modules()
                if hasattr(m, "_diffusers_hook")
                for hook in m._diffusers_hook.hooks.values()
                if getattr(hook, "_is_stateful", False)
            ]
            for block_probe, attention_probe in adapter.probes(transformer):
                self._handles.append(block_probe.register_forward_pre_hook(self._count_block))
                self._handles.append(attention_probe.register_forward_pre_hook(self._count_attention))

    def end_run(self) -> None:
        """Remove the hooks and probes (also after a failed item: the next one installs afresh)."""
        installed, handles = self._installed, self._handles
        self._installed, self._handles, self._now, self._hooks, self._pab_states = [], [], None, {}, {}
        for handle in handles:
            handle.remove()
        for transformer in installed:
            if getattr(transformer, "_cache_config", None) is not None:
                transformer.disable_cache()

    def begin_step(self, step: int, timestep) -> None:
        self.step, self.timestep = step, float(timestep)

    @contextlib.contextmanager
    def forward(self, transformer, branch: str):
        """One transformer evaluation of CFG branch `branch` ("cond"/"uncond"): its cache context."""
        self._now = _Forward(self.step, branch)
        try:
            with transformer.cache_context(branch):
                fresh = self._own_state(transformer, branch)
                yield
                for state in fresh:  # updated at this step of the run, not at the hook's own step 0
                    state.current_step = state.last_update_step = self.step
        finally:
            self._now.blocks, self._now.attention = len(self._now.block_ids), len(self._now.attention_ids)
            self.forwards.append(self._now)
            self._now = None

    def _own_state(self, transformer, branch: str) -> None:
        """What diffusers' hooks get wrong when CFG branches run one after the other and experts
        take turns: PAB keeps one state for both branches (the second would reuse the first's
        attention of the same step), and MagCache and TaylorSeer count steps per expert (the
        second expert would start at step 0). Each branch gets its own PAB state, and the
        step counters are set to the step of the run; a TaylorSeer state that has seen no step yet
        (an expert's first) computes. Returns those states, to date their update after the forward."""
        from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastState

        fresh = []
        for hook in self._hooks.get(id(transformer), ()):
            kind = type(hook).__name__
            if kind == "PyramidAttentionBroadcastHook":
                hook.state = self._pab_states.setdefault((id(hook), branch), PyramidAttentionBroadcastState())
            elif kind == "TaylorSeerCacheHook":
                state = hook.state_manager.get_state()
                if state.last_update_step is None and self.step > 0:
                    state.current_step = -1  # the hook adds one: its warm-up step 0, which computes
                    fresh.append(state)
                else:
                    state.current_step = self.step - 1  # the hook adds one
            elif kind == "MagCacheHeadHook":
                hook.state_manager.get_state().step_index = self.step
        return fresh

    def _count_block(self, module, args) -> None:
        if self._now is not None:
            self._now.block_ids.add(id(module))

    def _count_attention(self, module, args) -> None:
        if self._now is not None:  # a set: a joint processor calls the projection twice
            self._now.attention_ids.add(id(module))

    # -- agreement -----------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            self.comm.all_reduce(t, dist.ReduceOp.SUM, self.group, self.ranks)
        return t

    def _agree(self, transformer, adapter) -> None:
        """Route the data-dependent decisions of the hooks just installed through one all-reduce."""
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
        from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK

        blocks = adapter.segment_blocks(transformer)
        if self.spec.name == "first-block":
            hook = HookRegistry.check_if_exists_or_initialize(blocks[0]).get_hook(_FBC_LEADER_BLOCK_HOOK)
            hook._should_compute_remaining_blocks = self._first_block_decision(hook)
        elif self.spec.name == "magcache" and self.calibrating:
            hook = HookRegistry.check_if_exists_or_initialize(blocks[-1]).get_hook(_MAG_CACHE_BLOCK_HOOK)
            hook._perform_calibration_step = self._calibration_step

    def _first_block_decision(self, hook):
        def should_compute(residual_BSC: torch.Tensor) -> bool:
            # diffusers: mean|r - r_prev| / mean|r_prev| > threshold, over the whole sequence:
            # a ratio of two sums, the same numbers one process would compare
            state = hook.state_manager.get_state()
            prev = state.head_block_residual
            if prev is None:
                return True
            sums = torch.stack([(residual_BSC - prev).float().abs().sum(), prev.float().abs().sum()])
            sums = self._all_reduce(sums)
            return bool(sums[0] > hook.threshold * sums[1])

        return should_compute

    def _calibration_step(self, state, residual_BSC: torch.Tensor) -> None:
        # diffusers: mean over tokens of |r_t| / |r_t-1| (per-token norms), agreed over the chunks
        if state.previous_residual is None:
            ratio = 1.0
        else:
            now = torch.linalg.norm(residual_BSC.float(), dim=-1)
            prev = torch.linalg.norm(state.previous_residual.float(), dim=-1)
            count = torch.tensor(float(now.numel()), device=now.device)
            sums = self._all_reduce(torch.stack([(now / (prev + 1e-8)).sum(), count]))
            ratio = float(sums[0] / sums[1])
        branch = self._now.branch if self._now is not None else "cond"
        self._calibrated.setdefault(branch, []).append(ratio)

    def take_calibration(self) -> dict[str, list[float]]:
        """The ratios a calibration run measured on this rank, per branch it ran."""
        measured = {b: [round(r, 6) for r in ratios] for b, ratios in self._calibrated.items()}
        self._calibrated = {}
        return measured

    # -- record --------------------------------------------------------------------------
    def record(self, layers: int, per_branch: dict | None = None) -> dict:
        """The item's record: per branch and step, the blocks and self-attention layers evaluated
        (of `layers` each), the steps whose blocks after the first were skipped, the fractions.
        `per_branch`: the per-step counts to summarise instead of this rank's (under
        --cfg-parallel, both branch groups' merged)."""
        if per_branch is None:
            per_branch = {}
            for f in self.forwards:
                per_branch.setdefault(f.branch, []).append([f.blocks, f.attention])
        counts = [c for steps in per_branch.values() for c in steps]
        total = len(counts) * layers
        blocks, attention = sum(n for n, _ in counts), sum(a for _, a in counts)
        record = {
            **self.spec.to_json(),
            "per_step": per_branch,  # branch -> [[blocks, self-attention layers] per step]
            "skipped_steps": {b: [i for i, (n, _) in enumerate(s) if n < layers] for b, s in per_branch.items()},
            "forwards": len(counts),
            "block_evals": blocks,
            "block_fraction": round(blocks / total, 6) if total else 1.0,
            "attention_evals": attention,
            "attention_fraction": round(attention / total, 6) if total else 1.0,
        }
        if self.spec.name == "magcache":
            record["mag_ratios"] = self.mag_ratios
        return record
