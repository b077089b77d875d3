"""The options of `generate`, `check` and `rehearse` mapped onto a RunConfig: everything that
can be checked before anything runs is checked here, once, so that the three commands refuse
the same inputs with the same message."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace

import torch

from ditango_cli.auto_layout import choose_layout
from ditango_cli.options import (
    DiTangoArgs,
    GuidanceArgs,
    ItemArgs,
    MemoryArgs,
    ModelArgs,
    OutputArgs,
    ParallelArgs,
    SlurmArgs,
)
from ditango_cli.requires import GENERATE_RULES, NOTHING_GIVEN, Given, RunSetting, check_given, without
from planner.ditango import DiTangoOptions, run_planner_config
from planner.errors import ConfigError
from planner.hybrid import HybridConfig
from planner.layout import replica_layout
from planner.memory import parse_bytes
from planner.user_files import user_path
from runtime.config import DecodeOptions, RunConfig, check_combination, check_timeouts
from runtime.errors import ModelDirError
from runtime.items import Overrides, build_items, fit_to_model
from runtime.kernels import resolve_backend
from runtime.memory_plan import check_local_cpu_ranks, memory_preflight, plan_host_memory
from runtime.models.loading import check_torch, placement_on
from runtime.models.registry import REGISTRY
from runtime.models.resolve import ResolvedModel, model_source, resolve_model
from runtime.out_folder import check_item_files, check_writable
from runtime.step_cache_options import parse_step_cache
from slurm.options import SlurmOptions, check_log_folder


def ditango_options(d: DiTangoArgs) -> DiTangoOptions:
    """--cache-ratio & co. onto the planner's config, by field name (planner/ditango.py's RUN_DEFAULTS
    where not given)."""
    names = (
        "cache_ratio",
        "warmup",
        "cooldown",
        "tau_max",
        "anchor_interval",
        "planner",
        "own_group",
        "anchor_when_all",
        "reuse",
    )
    planner = run_planner_config(**{k: getattr(d, k) for k in names}, use_alpha=bool(d.alpha))
    limit = None if d.cache_memory_limit is None else parse_bytes(d.cache_memory_limit, "--cache-memory-limit")
    if d.target_psnr is not None and d.cache_ratio is not None:
        raise ConfigError("--target-psnr chooses the cache ratio: give it or --cache-ratio, not both")
    return DiTangoOptions(planner, d.cache_dtype, limit, d.target_psnr)


def hybrid_config(g: GuidanceArgs, layers: int) -> HybridConfig | None:
    tuned = {k: getattr(g, f"hybrid_{k}") for k in ("k", "window", "slope", "tau_cap", "split")}
    if not g.hybrid:  # its tuning without it: ditango_cli/requires.py
        return None
    if not g.cfg_parallel:
        raise ConfigError("--hybrid needs --cfg-parallel (the two CFG branches on two rank groups)")
    hybrid = HybridConfig(**tuned, first_segment_text=g.hybrid_first_text)  # type: ignore[arg-type]
    hybrid.split_for(layers)
    return hybrid


def slurm_options(s: SlurmArgs) -> SlurmOptions:
    """By field name; --time is `time_min`, the --slurm-arg pairs are `extra`."""
    same = {f.name: getattr(s, f.name) for f in fields(SlurmOptions) if hasattr(s, f.name)}
    return SlurmOptions(**same, time_min=s.time, extra=SlurmOptions.parse_extra(s.slurm_arg or []))


def build_run_config(
    m: ModelArgs, i: ItemArgs, o: OutputArgs, p: ParallelArgs, d: DiTangoArgs, g: GuidanceArgs, mem: MemoryArgs, *,
    where: str, create_out: bool, options: dict | None = None, array: int = 1, weights: bool = True,
    warn: Callable[[str], None] | None = None, given: Given = NOTHING_GIVEN,
) -> tuple[RunConfig, ResolvedModel | None]:  # fmt: skip
    """Validate everything that can be checked before anything runs; `where`: the executor
    (local, srun, sbatch), which decides what the device checks are made against; `array`:
    the array tasks the items are split over; `weights` False: a registry name needs no
    checkpoint (a rehearsal builds it from its configs; the resolved model is then None); `warn`
    given (a dry run, a rehearsal): what would refuse the run before it queues, a torch without
    CUDA for GPU ranks, is said through it instead, and nothing is downloaded; `given`: the options
    the user set (an option that means nothing in this run is refused, or a run file's left out:
    ditango_cli/requires.py). `generate` and `check` both validate here, so they refuse the same
    inputs with the same message."""
    from runtime.cache import check_cache_limit
    from slurm.placement import cpu_only_torch, ranks_device

    check_torch()
    named = REGISTRY.get(m.model)  # a named model's spec: the memory pre-flight needs no weights
    fetch = m.download and warn is None  # a dry run never downloads
    resolved = None
    if named is None:
        try:
            resolved = resolve_model(m.model, m.model_root, m.revision, fetch)
        except ModelDirError:
            if not (m.download and warn is not None):
                raise
            raise ConfigError(  # the plan needs its config, which a dry run does not download
                f"{m.model} is not here yet: the run would download it first (--download); to see its plan, fetch it "
                f"now with: ditango download {m.model}"
            ) from None
    spec = named or resolved.spec
    overrides = Overrides(**{k: getattr(i, k) for k in Overrides.__dataclass_fields__})
    items = build_items(i.prompt, i.prompts, overrides, spec.defaults)
    items = fit_to_model(items, spec, None if resolved is None else resolved.path)  # LoRAs, solvers
    if array > len(items):
        raise ConfigError(f"--array {array} is more than the {len(items)} items")
    p, g, d, mem, choice = choose_layout(p, g, d, mem, spec, items, array)  # --layout auto, else as given
    strategy = None if p.parallel is None else p.parallel.value
    layout = replica_layout(
        p.nodes, p.gpus_per_node, p.replicas, spec.heads, strategy=strategy, cfg_parallel=g.cfg_parallel,
        ulysses_degree=p.ulysses_degree, group_size=d.group_size, ffn=spec.shape.ffn, joint_text=spec.shape.joint_text,
    )  # fmt: skip
    if g.hybrid and spec.shape.joint_text and g.hybrid_first_text != "cond":
        raise ConfigError(f"--hybrid-first-text uncond does not apply to {spec.name}, whose text stream runs through "
                          "the blocks: segment B must continue the conditional one")  # fmt: skip
    step_cache = None if p.step_cache is None else parse_step_cache(p.step_cache)
    check_combination(layout.strategy, g.hybrid, mem.shard_weights, step_cache)
    parallel_decode = layout.world_size > 1 and mem.vae_parallel is not False
    decode = DecodeOptions(tiling=mem.vae_tiling, parallel=parallel_decode, tile_px=mem.vae_tile)
    setting = RunSetting(
        where=where,
        model_from=model_source(m.model),
        layout_auto=p.layout is not None,
        strategy=layout.strategy,
        world_size=layout.world_size,
        cp_degree=layout.cp_degree,
        hybrid=g.hybrid,
        tiled_decode=decode.tiled,
        step_cache=step_cache is not None,
        vae_parallel=mem.vae_parallel,
    )
    moot = check_given(GENERATE_RULES, given, setting)  # the run file's, left out with a note
    p, d, g, mem = (without(group, moot) for group in (p, d, g, mem))
    decode = replace(decode, tile_px=mem.vae_tile)
    check_timeouts(p.timeout, p.setup_timeout)
    device = ranks_device(where, m.device.value, layout.world_size * p.replicas, p.gpus_per_node)
    if problem := cpu_only_torch(device):  # the jobs run this environment: refused before anything queues
        if warn is None:
            raise ConfigError(problem)
        warn(f"warning: {problem}")
    placement = placement_on(torch.device(device), None if m.dtype is None else m.dtype.value)
    ditango = ditango_options(d) if layout.strategy.reuses else None
    if ditango is not None:  # fail now, not inside the ranks
        check_cache_limit(ditango, items, layout, spec.heads, spec.head_dim, spec.layers, placement.device)
    if layout.strategy.runtime is not None:
        resolve_backend(p.attention_backend.value, placement.device, placement.dtype, where == "local")
    cfg = RunConfig(
        model=m.model, model_path=None,
        items=items, out_dir=user_path(o.out, "--out"), device=device, dtype=None if m.dtype is None else m.dtype.value,
        save_latents=o.save_latents, overwrite=o.overwrite, profile=o.profile,
        max_text_len=spec.defaults.max_text_len,
        layout=layout, attention_backend=p.attention_backend.value, timeout_s=p.timeout,
        setup_timeout_s=p.setup_timeout_s, ditango=ditango, reference=d.reference, step_cache=step_cache,
        hybrid=hybrid_config(g, spec.layers), replicas=p.replicas, alloc_gpus_per_node=p.gpus_per_node, decode=decode,
        shard_weights=mem.shard_weights, layout_choice=choice,
        options=options or {},
    )  # fmt: skip
    cfg = memory_preflight(cfg, spec.shape, mem.gpu_memory, placement, where == "local", m.dtype is not None)
    cfg = plan_host_memory(cfg, spec.shape, placement.dtype.itemsize)  # a submission's --mem
    if where != "local":  # last of the options' checks: a refused command leaves no folder behind
        check_log_folder(o.out)
    check_writable(o.out, create=create_out)
    check_item_files(cfg)
    if not weights and resolved is None:
        return cfg, None
    if resolved is None and warn is not None:  # a dry run of a named model: its plan needs no weights
        try:
            resolved = resolve_model(m.model, m.model_root, m.revision)
        except ModelDirError as exc:
            warn(f"note: {m.model} is not here yet: the run would download it first (--download)" if m.download
                 else f"warning: the run would stop here: {exc}")  # fmt: skip
            return cfg, None
    resolved = resolved or resolve_model(m.model, m.model_root, m.revision, fetch)
    if where == "local" and placement.device.type == "cpu":  # after the model: a missing one is said first
        check_local_cpu_ranks(cfg, spec.shape, placement.dtype.itemsize)
    return replace(cfg, model_path=None if spec.builtin else resolved.path), resolved  # built-in: this code's copy
