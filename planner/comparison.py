"""What `ditango simulate` prints: every strategy on 1..N nodes priced by the cost model
(planner/cost_model.py), with its speedup over the best exact one, its predicted peak memory
per GPU (planner/memory.py) and, for DiTango, what its replayed plan computed."""

from __future__ import annotations

from dataclasses import replace

from basics.errors import ConfigError
from planner.cost_model import Estimate, Hardware, estimate, report_dict
from planner.ditango import RUN_DEFAULTS
from planner.layout import ParallelLayout, parse_group_size
from planner.memory import MemoryOptions, cfg_branches, estimate_memory
from planner.models import ModelShape, VideoSize
from planner.plan_shape import PlanReplay, PlanSource, recorded_source
from planner.preflight import fit_to_memory, usable_bytes
from planner.strategy import STRATEGIES, strategy_named


def simulate_assumptions(
    hw: Hardware, model: str, tokens: int, steps: int, source: PlanSource, notes: list[str]
) -> dict:
    """The `assumptions` of `ditango simulate --json`: the profile, ASSUMPTIONS and the run's inputs."""
    planner = source.shapes[0].planner if source.shapes else None
    return {
        **report_dict(hw),
        "model": model,
        "tokens": tokens,
        "steps": steps,
        "ditango_plan": source.description,
        "ditango_planner": planner,
        "ditango_cache_ratio": source.cache_ratio if source.shapes else None,
        "ditango_own_group": source.own_group,
        "ditango_warmup": source.warmup,
        "ditango_cooldown": source.cooldown,
        "skipped": notes,
    }


def memory_options(
    shard_weights: bool, cfg_scale: float, vae_tiling: bool, cache_dtype: str, quantize: str = "none"
) -> MemoryOptions:
    """simulate's memory options: bf16 weights (fp8 ones with `quantize`), CFG branches in turn on
    each rank (no cfg-parallel)."""
    return MemoryOptions(
        shard_weights=shard_weights,
        cfg_branches_per_rank=cfg_branches(cfg_scale, 1),
        vae_tiling=vae_tiling,
        cache_bytes=4 if cache_dtype == "float32" else 2,
        quantize=quantize,
    )


def memory_row(
    shape: ModelShape,
    layout: ParallelLayout,
    size: VideoSize,
    options: MemoryOptions,
    vae_parallel: bool | None,
    gpu_memory_bytes: int | None,
) -> dict:
    """`simulate`'s memory columns for one layout (planner/memory.py), with the offloads the
    runtime turns on when memory is short; `vae_parallel` None: on with more than one rank."""
    o = replace(options, vae_parallel=layout.world_size > 1 if vae_parallel is None else vae_parallel)
    if gpu_memory_bytes:
        o = fit_to_memory(shape, layout, size, o, gpu_memory_bytes)
    est = estimate_memory(shape, layout, size, o)
    return {
        "peak_memory_bytes": est.peak_bytes,
        "peak_memory_stage": est.peak_stage,
        "weights_bytes": est.stages["weights"],
        "offload": [
            n for n, on in (("encoders", o.offload_text_encoder), ("transformer", o.offload_transformer)) if on
        ],
        "fits": est.peak_bytes <= usable_bytes(gpu_memory_bytes) if gpu_memory_bytes else None,
    }


def compare_layouts(
    hw: Hardware,
    shape: ModelShape,
    nodes: int,
    gpus_per_node: int,
    strategies: list[str],
    group_size: str | None,
    size: VideoSize,
    steps: int,
    source: PlanSource | None = None,
    memory: MemoryOptions = MemoryOptions(),
    vae_parallel: bool | None = None,
    gpu_memory_bytes: int | None = None,
    compile: bool = False,
    attention: str = "flash",
) -> tuple[list[dict], list[str]]:
    """`ditango simulate`'s rows: every strategy on 1..`nodes` nodes, with the speedup over the
    best exact one and the predicted peak memory per GPU; and a note per illegal layout.
    DiTango replays `source`'s plan on each layout (default: the recorded
    shapes of the run defaults' planner and cache ratio); its row's `ditango` says what the replay computed, with
    notes where the recording did not cover the layout or ratio.
    `gpu_memory_bytes` (default: the profile's) decides `fits`. `memory.quantize` and `compile`
    price the blocks as `--quantize` and `--compile` run them, `attention` (flash or flash3) the
    attention kernel (planner/precision.py)."""
    priced = [n for n, s in STRATEGIES.items() if s.runtime is not None]
    for s in strategies:
        if s not in priced:
            raise ConfigError(f"--parallel {s!r}: simulate knows {', '.join(priced)}")
    source = source or recorded_source(RUN_DEFAULTS.planner, RUN_DEFAULTS.cache_ratio)
    gpu_memory_bytes = gpu_memory_bytes or hw.memory_bytes or None
    rows, notes = [], []
    for n in range(1, nodes + 1):
        found = []
        for s in strategies:
            try:
                strategy = strategy_named(s)
                group = None  # generate's default (ParallelLayout.group_size)
                if "group_size" in strategy.options and group_size is not None:
                    group = parse_group_size(group_size, gpus_per_node)
                layout = ParallelLayout(n, gpus_per_node, 1, strategy, None, group).with_defaults(shape.heads)
                layout.check_model(shape.heads, shape.ffn, shape.joint_text, shape.own_guidance)
                if memory.quantize != "none" and layout.strategy.splits_weights:
                    raise ConfigError(f"--quantize {memory.quantize} does not combine with it")
            except (ConfigError, ValueError) as exc:
                notes.append(f"{s} on {n} node(s): {exc}")
                continue
            precision = {"quantize": memory.quantize, "compile": compile, "attention": attention}
            est, plan = _priced(hw, layout, shape, size, steps, source, memory.shard_weights, precision)
            mem = memory_row(shape, layout, size, memory, vae_parallel, gpu_memory_bytes)
            summary = _plan_summary(plan)
            found.append((est, mem, summary and {**summary, "group_size": layout.group}, layout.strategy))
        exact = [e.e2e_s for e, _, _, strategy in found if not strategy.reuses]
        best = min(exact) if exact else None
        for e, mem, plan, _ in found:
            rows.append(
                {
                    "strategy": e.strategy,
                    "nodes": e.nodes,
                    "gpus_per_node": e.gpus_per_node,
                    "attention_s": round(e.attention_s, 6),
                    "step_s": round(e.step_s, 6),
                    "e2e_s": round(e.e2e_s, 4),
                    "inter_node_bytes": e.inter_node_bytes,
                    "intra_node_bytes": e.intra_node_bytes,
                    "speedup_vs_best_exact": None if best is None else round(best / e.e2e_s, 4),
                    **mem,
                    **({"ditango": plan} if plan else {}),
                }
            )
    return rows, notes


def _priced(
    hw: Hardware,
    layout: ParallelLayout,
    shape: ModelShape,
    size: VideoSize,
    steps: int,
    source: PlanSource,
    shard: bool = False,
    precision: dict | None = None,
) -> tuple[Estimate, PlanReplay | float | None]:
    """One layout's estimate; for DiTango, with the plan replayed on it; `shard`: --shard-weights
    (its weight gathers counted in the bytes); `precision`: `estimate`'s quantize, compile and attention."""
    shard = shard and not layout.strategy.splits_weights
    kwargs = {"shard_weights": shard, **(precision or {})}
    if not layout.strategy.reuses:
        return estimate(hw, layout, shape, size, steps, **kwargs), None
    plan = source.replay(layout, shape.layers, steps)
    if not isinstance(plan, PlanReplay):  # a flat fraction: no step kinds, no control bytes
        return estimate(
            hw, layout, shape, size, steps, compute_fraction=plan, own_group=source.own_group, **kwargs
        ), plan
    est = estimate(
        hw,
        layout,
        shape,
        size,
        steps,
        compute_fraction=plan.unit_fractions,
        own_group=source.own_group,
        plan_kinds=plan.kinds,
        planner=plan.planner,
        **kwargs,
    )
    return est, plan


def _plan_summary(plan: PlanReplay | float | None) -> dict | None:
    if plan is None:
        return None
    if isinstance(plan, PlanReplay):
        return {**plan.summary(), "notes": list(plan.notes)}
    return {
        "computed_fraction_all_steps": round(plan, 4),
        "computed_fraction_selective": None,
        "steps": None,
        "notes": [],
    }


def precision_rows(hw: Hardware, rows: list[dict], shape: ModelShape, size: VideoSize, steps: int, shard: bool) -> dict:
    """The fastest exact row's layout priced eager and compiled, in bf16 and (where the profile has
    an FP8 peak and the layout keeps whole weights) fp8, with flash-attn 2 class attention; and
    compiled under FlashAttention-3 (`_flash3`) where the profile has a `flash3_efficiency`:
    `ditango simulate`'s precision section."""
    exact = [r for r in rows if not STRATEGIES[r["strategy"]].reuses]
    if not exact:
        return {}
    best = min(exact, key=lambda r: r["e2e_s"])
    layout = ParallelLayout(best["nodes"], best["gpus_per_node"], 1, best["strategy"]).with_defaults(shape.heads)
    quantize = ["none"] + (["fp8"] if hw.fp8_tflops is not None and not layout.strategy.splits_weights else [])
    cases = [(q, c, "flash") for q in quantize for c in (False, True)]
    cases += [(q, True, "flash3") for q in quantize] if hw.flash3_efficiency is not None else []
    priced = {
        f"{q}{'_compiled' if c else ''}{'_flash3' if a == 'flash3' else ''}": round(
            estimate(hw, layout, shape, size, steps, shard_weights=shard, quantize=q, compile=c, attention=a).e2e_s, 4
        )
        for q, c, a in cases
    }
    return {"strategy": best["strategy"], "nodes": best["nodes"], "e2e_s": priced}
