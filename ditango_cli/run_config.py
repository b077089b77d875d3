"""The options of `generate`, `check` and `rehearse` mapped onto a RunConfig: everything that
can be checked before anything runs is checked here, once, so that the three commands refuse
the same inputs with the same message."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace

import torch
import typer

from basics.errors import ConfigError
from basics.user_files import user_path
from ditango_cli.auto_layout import choose_layout
from ditango_cli.options import DiTangoArgs, GuidanceArgs, RunOptions, SlurmArgs
from ditango_cli.requires import GENERATE_RULES, NOTHING_GIVEN, Given, RunSetting, check_given
from planner.ditango import DiTangoOptions, run_planner_config
from planner.hybrid import HybridConfig
from planner.layout import replica_layout
from planner.memory import parse_bytes
from planner.strategy import STRATEGIES, Strategy
from runtime.config import DecodeOptions, RunConfig
from runtime.errors import ModelDirError
from runtime.items import Overrides, build_items, fit_to_model
from runtime.kernels import passes_attention_mask, resolve_backend
from runtime.memory_plan import check_local_cpu_ranks, memory_preflight, plan_host_memory
from runtime.models.loading import check_torch, placement_on
from runtime.models.registry import REGISTRY
from runtime.models.resolve import ResolvedModel, model_source, resolve_model
from runtime.out_folder import check_item_files, check_writable
from runtime.step_cache_options import parse_step_cache
from slurm.options import SlurmOptions, check_log_folder


def ditango_options(ditango: DiTangoArgs) -> DiTangoOptions:
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
    planner = run_planner_config(**{k: getattr(ditango, k) for k in names}, use_alpha=bool(ditango.alpha))
    limit = (
        None if ditango.cache_memory_limit is None else parse_bytes(ditango.cache_memory_limit, "--cache-memory-limit")
    )
    if ditango.target_psnr is not None and ditango.cache_ratio is not None:
        raise ConfigError("--target-psnr chooses the cache ratio: give it or --cache-ratio, not both")
    return DiTangoOptions(planner, ditango.cache_dtype, limit, ditango.target_psnr)


def hybrid_config(guidance: GuidanceArgs, layers: int) -> HybridConfig | None:
    tuned = {k: getattr(guidance, f"hybrid_{k}") for k in ("k", "window", "slope", "tau_cap", "split")}
    if not guidance.hybrid:  # its tuning without it: ditango_cli/requires.py
        return None
    if not guidance.cfg_parallel:
        raise ConfigError("--hybrid needs --cfg-parallel (the two CFG branches on two rank groups)")
    hybrid = HybridConfig(**tuned, first_segment_text=guidance.hybrid_first_text)  # type: ignore[arg-type]
    hybrid.split_for(layers)
    return hybrid


def slurm_options(slurm: SlurmArgs) -> SlurmOptions:
    """By field name; --time is `time_min`, the --slurm-arg pairs are `extra`."""
    same = {f.name: getattr(slurm, f.name) for f in fields(SlurmOptions) if hasattr(slurm, f.name)}
    return SlurmOptions(**same, time_min=slurm.time, extra=SlurmOptions.parse_extra(slurm.slurm_arg or []))


def build_run_config(
    args: RunOptions,
    *,
    where: str,
    create_out: bool,
    options: dict | None = None,
    array: int = 1,
    weights: bool = True,
    warn: Callable[[str], None] | None = None,
    given: Given = NOTHING_GIVEN,
    queue: str = "shared",
) -> tuple[RunConfig, ResolvedModel | None]:
    """Validate everything that can be checked before anything runs; `where`: the executor
    (local, srun, sbatch), which decides what the device checks are made against; `array`:
    the array tasks the items are split over; `weights` False: a registry name needs no
    checkpoint (a rehearsal builds it from its configs; the resolved model is then None); `warn`
    given (a dry run, a rehearsal): what would refuse the run before it queues, a torch without
    CUDA for GPU ranks, is said through it instead, and nothing is downloaded; `given`: the options
    the user set (an option that means nothing in this run is refused, or a run file's left out:
    ditango_cli/requires.py); `queue`: how the items reach the replicas (--queue, which --layout
    auto prices). `generate` and `check` both validate here, so they refuse the same inputs with
    the same message."""
    from runtime.cache import check_cache_limit
    from slurm.placement import cpu_only_torch, ranks_device

    spec, resolved, items = model_and_items(args, array, warn)
    # --layout auto, or no strategy named on several GPUs: the search's; else as given
    args, choice, chosen = choose_layout(args, spec, items, array, queue, launched=where == "env")
    layout = layout_of(args, spec)
    step_cache = None if args.parallel.step_cache is None else parse_step_cache(args.parallel.step_cache)
    check_own_guidance(spec, layout, args.guidance.hybrid, step_cache)
    args = args.without(checked_rules(args, layout, step_cache, where, given))  # the run file's moot ones
    device = ranks_device(
        where, args.model.device.value, layout.world_size * args.parallel.replicas, args.parallel.gpus_per_node
    )
    if problem := cpu_only_torch(device):  # the jobs run this environment: refused before anything queues
        if warn is None:
            raise ConfigError(problem)
        warn(f"warning: {problem}")
    placement = placement_on(torch.device(device), None if args.model.dtype is None else args.model.dtype.value)
    if problem := fp8_device_problem(args.model.quantize.value, placement.device, where):
        if warn is None:
            raise ConfigError(problem)
        warn(f"warning: {problem}")
    ditango = ditango_options(args.ditango) if layout.strategy.reuses else None
    if ditango is not None:  # fail now, not inside the ranks
        check_cache_limit(ditango, items, layout, spec.heads, spec.head_dim, spec.layers, placement.device)
    one_rank = layout.strategy.runtime is None  # diffusers' attention runs the kernel
    masked = one_rank and passes_attention_mask(spec.family)
    resolve_backend(
        args.parallel.attention_backend.value, placement.device, placement.dtype, where == "local", one_rank, masked
    )
    cfg = RunConfig(  # its own rules (runtime/config.py) checked here, once
        model=args.model.model,
        model_path=None,
        items=items,
        out_dir=user_path(args.output.out, "--out"),
        device=device,
        dtype=None if args.model.dtype is None else args.model.dtype.value,
        save_latents=args.output.save_latents,
        no_audio=args.output.no_audio,
        overwrite=args.output.overwrite,
        profile=args.output.profile,
        max_text_len=spec.defaults.max_text_len,
        layout=layout,
        attention_backend=args.parallel.attention_backend.value,
        timeout_s=args.parallel.timeout,
        setup_timeout_s=args.parallel.setup_timeout_s,
        ditango=ditango,
        reference=args.ditango.reference,
        step_cache=step_cache,
        hybrid=hybrid_config(args.guidance, spec.layers),
        replicas=args.parallel.replicas,
        alloc_gpus_per_node=args.parallel.gpus_per_node,
        decode=decode_options(args, layout),
        shard_weights=args.memory.shard_weights,
        compile=placement.device.type == "cuda" if args.model.compile is None else args.model.compile,
        quantize=args.model.quantize.value,
        layout_choice=choice,
        options=options or {},
    )
    cfg = memory_preflight(
        cfg, spec.shape, args.memory.gpu_memory, placement, where == "local", args.model.dtype is not None
    )
    cfg = plan_host_memory(cfg, spec.shape, placement.dtype.itemsize)  # a submission's --mem
    if where != "local":  # last of the options' checks: a refused command leaves no folder behind
        check_log_folder(args.output.out)
    check_writable(args.output.out, create=create_out)
    check_item_files(cfg)
    if weights or resolved is not None:
        cfg, resolved = with_model(cfg, args, spec, resolved, placement, where, warn)
    if chosen is not None:  # the search's choice, said once nothing refused the run
        typer.echo(chosen, err=True)
    return cfg, resolved


def fp8_device_problem(quantize: str, device: torch.device, where: str) -> str | None:
    """`--quantize fp8` on this machine's GPU without FP8 matmuls (compute capability below 8.9,
    planner/precision.py): the refusal, or None. Only a local run's GPU is here to ask; a
    submission's ranks refuse on theirs (and --layout auto checks its --hardware profile)."""
    from planner.precision import check_fp8_device

    if quantize != "fp8" or where != "local":
        return None
    if device.type == "cpu":
        from runtime.quantize import fp8_matmul_problem

        return fp8_matmul_problem("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        check_fp8_device(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    except ConfigError as exc:
        return str(exc)
    return None


def model_and_items(args: RunOptions, array: int, warn) -> tuple:
    """(spec, resolved model or None, items): a registry name's spec needs no weights (the
    memory pre-flight reads its shape), any other model is resolved (and downloaded with
    --download, but never by a dry run); the items built and fitted to the model."""
    check_torch()
    model = args.model
    named = REGISTRY.get(model.model)
    resolved = None
    if named is None:
        try:
            resolved = resolve_model(model.model, model.model_root, model.revision, model.download and warn is None)
        except ModelDirError:
            if not (model.download and warn is not None):
                raise
            raise ConfigError(  # the plan needs its config, which a dry run does not download
                f"{model.model} is not here yet: the run would download it first (--download); to see its plan, "
                f"fetch it now with: ditango download {model.model}"
            ) from None
    spec = named or resolved.spec
    overrides = Overrides(**{k: getattr(args.items, k) for k in Overrides.__dataclass_fields__})
    items = build_items(args.items.prompt, args.items.prompts, overrides, spec.defaults)
    items = fit_to_model(items, spec, None if resolved is None else resolved.path)  # LoRAs, solvers
    if array > len(items):
        raise ConfigError(f"--array {array} is more than the {len(items)} items")
    return spec, resolved, items


def layout_of(args: RunOptions, spec):
    """One replica's layout for the model (planner/layout.py `replica_layout`)."""
    parallel, guidance = args.parallel, args.guidance
    if guidance.hybrid and spec.shape.joint_text and guidance.hybrid_first_text != "cond":
        raise ConfigError(
            f"--hybrid-first-text uncond does not apply to {spec.name}, whose text stream runs through "
            "the blocks: segment B must continue the conditional one"
        )
    return replica_layout(
        parallel.nodes,
        parallel.gpus_per_node,
        parallel.replicas,
        spec.heads,
        strategy=None if parallel.parallel is None else parallel.parallel.value,
        cfg_parallel=guidance.cfg_parallel,
        ulysses_degree=parallel.ulysses_degree,
        group_size=args.ditango.group_size,
        ffn=spec.shape.ffn,
        joint_text=spec.shape.joint_text,
        own_guidance=spec.shape.own_guidance,
    )


def check_own_guidance(spec, layout, hybrid: bool, step_cache) -> None:
    """A model whose pipeline guides with more forwards than a conditional and an unconditional
    one (LTX-2: spatio-temporal and modality guidance too) runs each forward fresh: Hybridiff's
    segments and a step cache's skips are refused by name (the layout refused the rest)."""
    if not spec.shape.own_guidance:
        return
    for option, given in (("--hybrid", hybrid), ("--step-cache", step_cache is not None)):
        if given:
            raise ConfigError(
                f"{option} does not apply to {spec.name}: its pipeline's guidance runs up to four forwards a step "
                "(CFG, spatio-temporal, modality); use ring, ulysses or usp"
            )


def decode_options(args: RunOptions, layout) -> DecodeOptions:
    """--vae-tiling, --vae-tile, and --vae-parallel (on by default over several ranks)."""
    memory = args.memory
    parallel = layout.world_size > 1 and memory.vae_parallel is not False
    return DecodeOptions(tiling=memory.vae_tiling, parallel=parallel, tile_px=memory.vae_tile)


def checked_rules(args: RunOptions, layout, step_cache, where: str, given: Given) -> set[str]:
    """The settings that do not run together (runtime/config.py `check_combination`), then which
    options need which others (ditango_cli/requires.py): a typed option that means nothing in
    this run is refused; a run file's is returned, to be left at its default."""
    check_combination(
        layout.strategy, args.guidance.hybrid, args.memory.shard_weights, step_cache, args.model.quantize.value
    )
    setting = RunSetting(
        where=where,
        model_from=model_source(args.model.model),
        layout_auto=args.parallel.layout is not None,
        strategy=layout.strategy,
        world_size=layout.world_size,
        cp_degree=layout.cp_degree,
        hybrid=args.guidance.hybrid,
        tiled_decode=decode_options(args, layout).tiled,
        step_cache=step_cache is not None,
        quantized=args.model.quantize.value != "none",
        vae_parallel=args.memory.vae_parallel,
    )
    return check_given(GENERATE_RULES, given, setting)


def check_combination(
    strategy: Strategy, hybrid: bool, shard_weights: bool, step_cache, quantize: str = "none"
) -> None:
    """The settings that do not run together, each refused with what would."""
    if quantize != "none" and strategy.splits_weights:
        raise ConfigError(
            f"--quantize {quantize} does not combine with --parallel {strategy} (it splits the layers fp8 replaces); "
            "use ring, ulysses, usp or ditango"
        )
    if hybrid and shard_weights:
        raise ConfigError("--shard-weights does not combine with --hybrid (its segments run different blocks)")
    if hybrid and not strategy.with_hybrid:
        takers = ", ".join(n for n, s in STRATEGIES.items() if s.with_hybrid and s.runtime is not None)
        raise ConfigError(f"--hybrid does not combine with --parallel {strategy}; use {takers}")
    if shard_weights and strategy.splits_weights:
        raise ConfigError(
            f"--shard-weights does not combine with --parallel {strategy} ({strategy} already splits the block weights)"
        )
    if step_cache is not None and hybrid:
        raise ConfigError("--step-cache does not combine with --hybrid (its segments run different blocks)")
    if step_cache is not None and step_cache.name in ("first-block", "magcache") and shard_weights:
        raise ConfigError(
            f"--step-cache {step_cache.name} does not combine with --shard-weights (FSDP wraps the "
            "blocks it hooks); use pab or taylorseer, or drop --shard-weights"
        )


def with_model(cfg: RunConfig, args: RunOptions, spec, resolved, placement, where: str, warn):
    """`cfg` with its model's folder, and the resolved model (a dry run of a named model whose
    weights are not here yet: `cfg` and None, with a note)."""
    model = args.model
    if resolved is None and warn is not None:  # a dry run of a named model: its plan needs no weights
        try:
            resolved = resolve_model(model.model, model.model_root, model.revision)
        except ModelDirError as exc:
            warn(
                f"note: {model.model} is not here yet: the run would download it first (--download)"
                if model.download
                else f"warning: the run would stop here: {exc}"
            )
            return cfg, None
    resolved = resolved or resolve_model(model.model, model.model_root, model.revision, model.download and warn is None)
    if where == "local" and placement.device.type == "cpu":  # after the model: a missing one is said first
        check_local_cpu_ranks(cfg, spec.shape, placement.dtype.itemsize)
    return replace(cfg, model_path=None if spec.builtin else resolved.path), resolved  # built-in: this code's copy
