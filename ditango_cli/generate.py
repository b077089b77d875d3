"""`ditango generate` and `check`: the options mapped onto a RunConfig, handed to
the supervisor (slurm/supervise.py) with the executor the run asks for, and rendered."""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from ditango_cli.auto_layout import choose_layout
from ditango_cli.command import command
from ditango_cli.options import (
    GROUPS,
    DiTangoArgs,
    ExecutorChoice,
    GenerateArgs,
    GuidanceArgs,
    ItemArgs,
    MemoryArgs,
    ModelArgs,
    OutputArgs,
    ParallelArgs,
    SlurmArgs,
)
from ditango_cli.tables import plain_console, print_tables
from planner.ditango import DiTangoOptions, run_planner_config
from planner.errors import ConfigError
from planner.hybrid import HybridConfig
from planner.layout import replica_layout
from planner.memory import parse_bytes
from runtime.config import (
    DecodeOptions,
    RunConfig,
    check_combination,
    check_local_cpu_ranks,
    check_timeouts,
    memory_preflight,
    plan_host_memory,
)
from runtime.errors import ModelDirError
from runtime.items import Overrides, build_items, fit_to_model
from runtime.kernels import resolve_backend
from runtime.models.loading import check_torch, placement_on, quiet_loading_bars
from runtime.models.registry import REGISTRY, ResolvedModel, resolve_model
from runtime.outputs import check_writable
from runtime.step_cache_options import parse_step_cache
from slurm.env import launcher_layout
from slurm.options import SlurmOptions, check_log_folder, choose_executor, host_request
from slurm.rank import launched_rank

EXIT_FAILED_ITEMS = 1


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
    )
    planner = run_planner_config(**{k: getattr(d, k) for k in names}, use_alpha=bool(d.alpha))
    limit = None if d.cache_memory_limit is None else parse_bytes(d.cache_memory_limit, "--cache-memory-limit")
    if d.target_psnr is not None and d.cache_ratio is not None:
        raise ConfigError("--target-psnr chooses the cache ratio: give it or --cache-ratio, not both")
    return DiTangoOptions(planner, d.cache_dtype, limit, d.target_psnr)


def hybrid_config(g: GuidanceArgs, layers: int) -> HybridConfig | None:
    tuned = {k: getattr(g, f"hybrid_{k}") for k in ("k", "window", "slope", "tau_cap", "split")}
    given = [f"--hybrid-{k.replace('_', '-')}" for k, v in tuned.items() if v is not None]
    given += ["--hybrid-first-text"] if g.hybrid_first_text != "cond" else []
    if not g.hybrid:
        if given:
            raise ConfigError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --hybrid")
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
    warn: Callable[[str], None] | None = None,
) -> tuple[RunConfig, ResolvedModel | None]:  # fmt: skip
    """Validate everything that can be checked before anything runs; `where`: the executor
    (local, srun, sbatch), which decides what the device checks are made against; `array`:
    the array tasks the items are split over; `weights` False: a registry name needs no
    checkpoint (a rehearsal builds it from its configs; the resolved model is then None); `warn`
    given (a dry run, a rehearsal): what would refuse the run before it queues, a torch without
    CUDA for GPU ranks, is said through it instead, and nothing is downloaded. `generate` and `check` both validate here, so they refuse
    the same inputs with the same message."""
    from runtime.strategies.selective import check_cache_limit
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
    # --reference exact measures what the run approximates: DiTango's reuse, a step cache, a tiled decode.
    ditango_only = [f for f in d.given() if f != "--reference" or not (decode.tiled or step_cache)]
    if layout.strategy != "ditango" and ditango_only:
        verb = "applies" if len(ditango_only) == 1 else "apply"
        raise ConfigError(f"{', '.join(ditango_only)} only {verb} to --parallel ditango")
    if mem.vae_tile is not None and not decode.tiled:
        raise ConfigError("--vae-tile only applies to a tiled decode: --vae-tiling, or --vae-parallel on several ranks")
    check_timeouts(p.timeout, p.setup_timeout)
    device = ranks_device(where, m.device.value, layout.world_size * p.replicas, p.gpus_per_node)
    if problem := cpu_only_torch(device):  # the jobs run this environment: refused before anything queues
        if warn is None:
            raise ConfigError(problem)
        warn(f"warning: {problem}")
    placement = placement_on(torch.device(device), None if m.dtype is None else m.dtype.value)
    ditango = ditango_options(d) if layout.strategy == "ditango" else None
    if ditango is not None:  # fail now, not inside the ranks
        check_cache_limit(ditango, items, layout, spec.heads, spec.head_dim, spec.layers, placement.device)
    if layout.strategy != "none":
        resolve_backend(p.attention_backend.value, placement.device, placement.dtype, where == "local")
    cfg = RunConfig(
        model=m.model, model_path=None,
        items=items, out_dir=o.out.expanduser(), device=device, dtype=None if m.dtype is None else m.dtype.value,
        save_latents=o.save_latents, overwrite=o.overwrite, max_text_len=spec.defaults.max_text_len,
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


@command(*GROUPS, GenerateArgs)
def generate(m, i, o, p, d, g, mem, s, r, run: GenerateArgs, options: dict) -> int:
    """Generate one MP4 per prompt, plus a sidecar JSON per item and report.json."""
    try:
        return _generate(m, i, o, p, d, g, mem, s, r, run, options)
    except KeyboardInterrupt:  # typer then exits 130 without a word
        from runtime.outputs import status_counts

        kept = status_counts(o.out, alive=False) if o.out.is_dir() else "nothing"
        typer.echo(f"interrupted: {o.out} keeps what finished ({kept}); the same command resumes the rest", err=True)
        raise


def _generate(m, i, o, p, d, g, mem, s, r, run: GenerateArgs, options: dict) -> int:
    from slurm.executors import executor_for, own_output_folder  # the runtime: only when work is asked for
    from slurm.supervise import supervise

    quiet_loading_bars()
    opts = slurm_options(s)
    ranks = p.nodes * p.gpus_per_node
    where = choose_executor(p.executor.value, p.nodes, opts, require_sbatch=not run.dry_run, ranks=ranks)
    p, launched = launcher_args(p, where)
    if launched is not None and m.download:  # every rank would fetch it, on nodes often offline
        raise ConfigError(
            f"--download under a launcher's ranks: fetch the model first, on a host that reaches the Hub "
            f"(ditango download {m.model}), into a cache or --model-root the ranks read"
        )
    if launched is not None and run.wait_for_lock:  # the other ranks would time out waiting for rank 0
        raise ConfigError(
            "--wait-for-lock under a launcher's ranks: start the job once the run that owns the folder has ended, "
            "or give this one another --out"
        )
    err = plain_console(stderr=True, soft_wrap=True)
    # Under a launcher only rank 0 speaks: every rank's output reaches the same console or log.
    quiet = run.quiet or (launched is not None and not launched.writer)
    say = (lambda text: None) if quiet else (lambda text: err.print(text, highlight=False, markup=False))
    cfg, _ = build_run_config(
        m, i, o, p, d, g, mem, where=where, create_out=not run.dry_run, options=options, array=opts.array,
        warn=say if run.dry_run else None,
    )  # fmt: skip
    cfg = replace(cfg, retries=run.retries)
    if note := cfg.layout.idle():
        say(f"note: {note}")
    if cfg.hybrid is not None and cfg.hybrid.scaled():
        for n in sorted({item.steps for item in cfg.items} - {50}):
            h = cfg.hybrid.resolved(n)
            say(f"note: --hybrid defaults are the paper's 50-step values scaled to {n} steps: k {h.k}, window "
                f"{h.window}, slope {h.slope:g}, tau cap {h.tau_cap}"
                + (" (k 1: the pipeline window is only its fill step)" if h.k == 1 else ""))  # fmt: skip
    if where == "sbatch":  # a request cut to what the partition's nodes have is said
        from slurm.submit import partition_node

        if note := host_request(cfg, opts, partition_node(opts))[2]:
            say(f"note: {note}")
    if run.dry_run:
        from ditango_cli.dry_run import show_dry_run

        return show_dry_run(cfg, opts, where, r.json)
    if launched is not None:
        return run_as_launched(cfg, launched, opts, run, err, say, r.json)
    if p.executor == ExecutorChoice.auto and where == "local" and cfg.nodes > 1:
        say(f"executor: local ({cfg.nodes} virtual nodes; no sbatch on PATH)")
    progress = progress_view(err, run.quiet or where != "local")
    with own_output_folder(cfg.out_dir, run.wait_for_lock, say), progress as observer:
        executor = executor_for(cfg, opts, where, s.wait, observer, say)
        outcome = supervise(cfg, executor, opts.array, observer.message if where == "local" else say)
    if outcome.submitted:
        typer.echo(
            f"submitted job(s) {', '.join(executor.job_ids)}; follow with: ditango status {shlex.quote(str(cfg.out_dir))}"
        )
        return 0
    if outcome.errors:
        for line in outcome.errors:
            typer.echo(f"error: {line}", err=True)
        if where != "local":
            executor.report()  # what finished is in report.json all the same
        return EXIT_FAILED_ITEMS
    return report_summary(executor.report(), cfg.out_dir / "report.json", run.quiet, r.json, err)


def progress_view(err: Console, quiet: bool):
    """The observer that shows this process's progress: none (`quiet`), the bar on a terminal,
    plain timestamped lines elsewhere (Slurm, nohup, `| tee`)."""
    from ditango_cli.progress import RichObserver
    from runtime.context import SilentObserver
    from runtime.progress import LogObserver

    if quiet:
        return contextlib.nullcontext(SilentObserver())
    return RichObserver(err) if err.is_terminal else LogObserver()


def launcher_args(p: ParallelArgs, where: str) -> tuple[ParallelArgs, object]:
    """Under a launcher's ranks (`where` env): --nodes and --gpus-per-node as its ranks make
    them, and this process's rank (slurm/rank.py LaunchedRank); else as they are, and None."""
    launched = launched_rank() if where == "env" else None
    if launched is None:
        return p, None
    if p.replicas > 1:
        raise ConfigError(
            "--replicas with a launcher's ranks: start one launcher job per replica (each its own --out), "
            "or use --executor local or slurm"
        )
    nodes, per_node = launcher_layout(launched, p.nodes, p.gpus_per_node)
    return replace(p, nodes=nodes, gpus_per_node=per_node), launched


def run_as_launched(cfg: RunConfig, launched, opts: SlurmOptions, run: GenerateArgs, err: Console, say,
                    as_json: bool) -> int:  # fmt: skip
    """`generate` as one rank of a launcher's (slurm/env.py): rank 0 draws progress and sums up."""
    from slurm.env import LaunchedRankFailed, run_launched

    progress = progress_view(err, run.quiet or not launched.writer)
    try:
        with progress as observer:
            report = run_launched(cfg, launched, opts.array, observer, say)
    except LaunchedRankFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        return EXIT_FAILED_ITEMS
    if not launched.writer:
        return 0
    return report_summary(report, cfg.out_dir / "report.json", run.quiet, as_json, err)


@command(*GROUPS)
def check(m, i, o, p, d, g, mem, s, r, options: dict) -> int:
    """Validate a would-be `generate` (model directory, prompts, sizes, output) without loading weights."""
    from runtime.outputs import plan_resume
    from slurm.executors import check_output_folder_free

    opts = slurm_options(s)
    where = choose_executor(p.executor.value, p.nodes, opts, ranks=p.nodes * p.gpus_per_node)
    p, _ = launcher_args(p, where)
    try:  # validation downloads nothing: --download is what generate would do
        cfg, resolved = build_run_config(replace(m, download=False), i, o, p, d, g, mem, where=where, create_out=False,
                                         array=opts.array)  # fmt: skip
    except ModelDirError:
        if not m.download:
            raise
        raise ConfigError(f"{m.model} is not here yet: generate --download would download it first, check does not; "
                          f"fetch it with: ditango download {m.model}") from None  # fmt: skip
    placement = placement_on(torch.device(cfg.device), cfg.dtype)
    check_output_folder_free(cfg.out_dir)  # generate would refuse an OUT that another run or live jobs own
    skipped = plan_resume(cfg) if cfg.out_dir.is_dir() else {}
    spec = resolved.spec
    backend = "diffusers" if cfg.layout.strategy == "none" else resolve_backend(
        cfg.attention_backend, placement.device, placement.dtype, where == "local")  # fmt: skip
    summary = {
        "model": cfg.model, "model_path": None if resolved.path is None else str(resolved.path),
        "transformer": {"params": spec.params, "heads": spec.heads, "layers": spec.layers, "head_dim": spec.head_dim,
                        "task": spec.task, "experts": spec.variant.experts},
        "device": str(placement.device), "dtype": placement.dtype_name, "out_dir": str(cfg.out_dir),
        "layout": cfg.layout.to_json(), "replicas": cfg.replicas, "executor": where, "attention_backend": backend,
        "gpu_memory": cfg.gpu_memory, "offload": list(cfg.offload), "layout_choice": cfg.layout_choice,
        "skipped": sorted(skipped),
        "items": [it.to_json() for it in cfg.items],
    }  # fmt: skip
    if r.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
        return 0
    console = plain_console()
    lay = cfg.layout
    console.print(
        f"model {summary['model']} ({summary['model_path'] or 'built-in'}), {spec.layers} layers, {spec.heads} heads; "
        f"device {summary['device']}, dtype {summary['dtype']}; out {summary['out_dir']}; {lay.world_size} rank(s)"
        + (f" x {cfg.replicas} replicas" if cfg.replicas > 1 else "")
        + f", strategy {lay.strategy} ("
        + (f"tp {lay.tp}" if lay.strategy == "tp" else f"ulysses {lay.ulysses} x ring {lay.ring}")
        + (f", group size {lay.group}" if lay.strategy == "ditango" else "")
        + f", attention {backend})",
        highlight=False,
    )
    if note := lay.idle():
        console.print(f"note: {note}", highlight=False)
    table = Table("id", "prompt", "seed", "size", "frames", "steps", "guidance", "tokens")
    for it in summary["items"]:
        short = it["prompt"] if len(it["prompt"]) <= 48 else it["prompt"][:45] + "..."
        table.add_row(it["id"], short, str(it["seed"]), f"{it['width']}x{it['height']}", str(it["frames"]),
                      str(it["steps"]), f"{it['guidance']:g}", str(it["tokens"]))  # fmt: skip
    print_tables(console, table)
    todo = len(cfg.items) - len(skipped)
    console.print(f"ok: {todo} item(s) would be generated, {len(skipped)} skipped (outputs exist)", highlight=False)
    return 0


def report_summary(report: dict, report_path: Path, quiet: bool, as_json: bool, err: Console) -> int:
    counts = report["counts"]
    if as_json:
        print(report_path)
    elif not quiet:
        err.print(
            f"{counts['done']} generated, {counts['skipped']} skipped, {counts['failed']} failed; report: {report_path}",
            highlight=False,
        )
    if counts["failed"]:
        failed = [rec for rec in report["items"] if rec["status"] == "failed"]
        first = (failed[0].get("error") or "").splitlines()[0] if failed and failed[0].get("error") else "?"
        typer.echo(f"error: {len(failed)} item(s) failed: {', '.join(rec['id'] for rec in failed)} "
                   f"(first: {first}; see {report_path})", err=True)  # fmt: skip
        return EXIT_FAILED_ITEMS
    return 0
