"""`ditango` commands: generate, check, models.

Parsing and validation only; the work is done by runtime/ (and, for multi-rank runs,
launched by slurm/). Predictable mistakes print one `error: ...` line on stderr and exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from ditango_cli.options import (
    AccountOpt,
    AlphaOpt,
    AnchorIntervalOpt,
    ArrayOpt,
    ArrayParOpt,
    BackendChoice,
    BackendOpt,
    CacheDtypeOpt,
    CacheLimitOpt,
    CacheRatioOpt,
    CfgParallelOpt,
    ConstraintOpt,
    CooldownOpt,
    CpusOpt,
    DeviceChoice,
    DeviceOpt,
    DryRunOpt,
    DTypeChoice,
    DTypeOpt,
    ExecutorChoice,
    ExecutorOpt,
    FramesOpt,
    GpusOpt,
    GroupSizeOpt,
    GuidanceOpt,
    HeightOpt,
    HybridCapOpt,
    HybridKOpt,
    HybridOpt,
    HybridSlopeOpt,
    HybridSplitOpt,
    HybridTextOpt,
    HybridWindowOpt,
    JsonOpt,
    MemOpt,
    ModelOpt,
    ModelRootOpt,
    NegativeOpt,
    NodesOpt,
    OutOpt,
    ParallelArgs,
    ParallelOpt,
    PartitionOpt,
    PromptOpt,
    PromptsOpt,
    QosOpt,
    ReferenceOpt,
    ReplicasOpt,
    RetriesOpt,
    SeedOpt,
    SetupTimeoutOpt,
    SlurmArgOpt,
    StepsOpt,
    TauMaxOpt,
    TimeOpt,
    TimeoutOpt,
    UlyssesOpt,
    WaitOpt,
    WarmupOpt,
    WidthOpt,
)
from ditango_cli.prompts import Overrides, build_items
from runtime.cache import anchor_bytes, compose_factor, unit_bytes
from runtime.config import RunConfig
from runtime.errors import ConfigError
from runtime.kernels import resolve_backend
from runtime.models.loading import placement_on
from runtime.models.registry import MODEL_ROOT_ENV, REGISTRY, ResolvedModel, model_root, resolve_model
from runtime.strategies.ditango import cache_dtype_for
from runtime.strategies.sharding import chunk_sizes

EXIT_USAGE = 2
EXIT_FAILED_ITEMS = 1


def _is_click_exception(exc: BaseException) -> bool:
    # Typer >= 0.25 vendors click (typer._click), older releases use click itself:
    # recognise either by class name rather than importing a private module.
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


class OneLineErrors(TyperGroup):
    """Usage and configuration errors become one `error: ...` line and exit code 2."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            result = super().main(*args, **kwargs)
        except ConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(130)
        except Exception as exc:
            if not _is_click_exception(exc):
                raise
            message = exc.format_message()
            if message:  # empty for "no arguments: help shown"
                typer.echo(f"error: {message}", err=True)
            sys.exit(exc.exit_code)
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Batch video generation with Diffusion Transformers.",
)


def check_writable(out: Path, create: bool) -> None:
    """Fail early (before loading anything) when outputs could not be written."""
    out = out.expanduser()
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError as exc:
            raise ConfigError(f"output dir {out} is not writable: {exc.strerror or exc}") from None
        return
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise ConfigError(f"output dir {out} is not writable: {probe} is not a writable directory")


def build_run_config(
    *,
    model: str,
    model_root_dir: Path | None,
    prompt: str | None,
    prompts: Path | None,
    overrides: Overrides,
    out: Path,
    device: DeviceChoice,
    dtype: DTypeChoice | None,
    save_latents: bool = False,
    overwrite: bool = False,
    parallel: ParallelArgs,
    create_out: bool,
    where: str = "local",
) -> tuple[RunConfig, ResolvedModel]:
    """Validate everything that can be checked before anything runs; `where`: the executor
    (local, srun, sbatch), which decides what the device checks are made against."""
    resolved = resolve_model(model, model_root_dir)
    items = build_items(prompt, prompts, overrides, resolved.spec.defaults)
    layout = parallel.layout(resolved.spec.heads)
    for item in items:
        if item.tokens() < layout.cp_degree:
            raise ConfigError(
                f"{item.source}: {item.tokens()} tokens cannot be split over {layout.cp_degree} ranks; "
                "use a larger size or fewer ranks"
            )
    if parallel.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {parallel.timeout:g}")
    from slurm.placement import ranks_device

    world = layout.world_size * parallel.replicas
    device_type = ranks_device(where, device.value, world, parallel.gpus_per_node)
    placement = placement_on(torch.device(device_type), None if dtype is None else dtype.value)
    ditango = parallel.ditango.options() if layout.strategy == "ditango" else None
    if ditango is not None and ditango.cache_limit_bytes is not None:  # fail now, not inside the ranks
        spec = resolved.spec
        cache_dtype = cache_dtype_for(ditango.cache_dtype, placement.device)
        for item in items:
            tokens = max(chunk_sizes(item.tokens(), layout.cp_degree))
            per_unit = unit_bytes(1, tokens, spec.heads, spec.head_dim, cache_dtype)
            branches = 1 if layout.cfg_degree == 2 or item.guidance <= 1 else 2
            anchors = branches * spec.layers * anchor_bytes(1, tokens, spec.heads)
            compose_factor(layout.groups - 1, branches, spec.layers, per_unit, ditango.cache_limit_bytes, anchors)
    if layout.strategy != "none":
        resolve_backend(
            parallel.attention_backend.value, placement.device, placement.dtype, check_installed=where == "local"
        )
    check_writable(out, create=create_out)
    cfg = RunConfig(
        model=model,
        model_path=None if resolved.spec.builtin else resolved.path,  # built-in: the running code's copy
        items=items,
        out_dir=out.expanduser(),
        device=device_type,
        dtype=None if dtype is None else dtype.value,
        save_latents=save_latents,
        overwrite=overwrite,
        max_text_len=resolved.spec.defaults.max_text_len,
        fps=resolved.spec.defaults.fps,
        layout=layout,
        attention_backend=parallel.attention_backend.value,
        timeout_s=parallel.timeout,
        setup_timeout_s=parallel.setup_timeout_s,
        ditango=ditango,
        reference=parallel.ditango.reference,
        hybrid=parallel.hybrid.config(resolved.spec.layers),
        replicas=parallel.replicas,
        alloc_gpus_per_node=parallel.gpus_per_node,
    )
    return cfg, resolved


@app.command()
def generate(
    model: ModelOpt = "tiny-wan",
    model_root_dir: ModelRootOpt = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    negative_prompt: NegativeOpt = None,
    seed: SeedOpt = 0,
    steps: StepsOpt = None,
    guidance: GuidanceOpt = None,
    height: HeightOpt = None,
    width: WidthOpt = None,
    frames: FramesOpt = None,
    out: OutOpt = Path("out"),
    save_latents: Annotated[bool, typer.Option("--save-latents", help="Also write <id>.latents.safetensors.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Regenerate items whose outputs exist.")] = False,
    dtype: DTypeOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    nodes: NodesOpt = 1,
    gpus_per_node: GpusOpt = 1,
    parallel: ParallelOpt = None,
    ulysses_degree: UlyssesOpt = None,
    executor: ExecutorOpt = ExecutorChoice.auto,
    replicas: ReplicasOpt = 1,
    timeout: TimeoutOpt = 600.0,
    setup_timeout: SetupTimeoutOpt = None,
    attention_backend: BackendOpt = BackendChoice.auto,
    cache_ratio: CacheRatioOpt = None,
    warmup: WarmupOpt = None,
    cooldown: CooldownOpt = None,
    group_size: GroupSizeOpt = None,
    tau_max: TauMaxOpt = None,
    anchor_interval: AnchorIntervalOpt = None,
    alpha: AlphaOpt = None,
    cache_dtype: CacheDtypeOpt = None,
    cache_memory_limit: CacheLimitOpt = None,
    reference: ReferenceOpt = None,
    cfg_parallel: CfgParallelOpt = False,
    hybrid: HybridOpt = False,
    hybrid_k: HybridKOpt = None,
    hybrid_window: HybridWindowOpt = None,
    hybrid_slope: HybridSlopeOpt = None,
    hybrid_tau_cap: HybridCapOpt = None,
    hybrid_split: HybridSplitOpt = None,
    hybrid_first_text: HybridTextOpt = "cond",
    partition: PartitionOpt = None,
    account: AccountOpt = None,
    qos: QosOpt = None,
    time_min: TimeOpt = 60,
    cpus_per_task: CpusOpt = None,
    mem: MemOpt = None,
    constraint: ConstraintOpt = None,
    slurm_arg: SlurmArgOpt = None,
    array: ArrayOpt = 1,
    array_parallelism: ArrayParOpt = None,
    wait_for_job: WaitOpt = True,
    retries: RetriesOpt = 1,
    dry_run: DryRunOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: JsonOpt = False,
) -> int:
    """Generate one MP4 per prompt, plus a sidecar JSON per item and report.json."""
    from ditango_cli.progress import RichObserver
    from runtime.run import SilentObserver  # heavy imports only when work is asked for
    from slurm.aggregate import aggregate
    from slurm.launch import launch
    from slurm.local import RankFailed
    from slurm.options import SlurmOptions, choose_executor
    from slurm.sharding import shard

    _quiet_libraries()
    overrides = Overrides(negative_prompt, seed, height, width, frames, steps, guidance)
    slurm_opts = SlurmOptions(
        partition=partition, account=account, qos=qos, time_min=time_min, cpus_per_task=cpus_per_task, mem=mem,
        constraint=constraint, extra=SlurmOptions.parse_extra(slurm_arg or []), array=array,
        array_parallelism=array_parallelism,
    )  # fmt: skip
    where = choose_executor(executor.value, nodes, slurm_opts, require_sbatch=not dry_run)
    cfg, _ = build_run_config(
        model=model, model_root_dir=model_root_dir, prompt=prompt, prompts=prompts, overrides=overrides,
        out=out, device=device, dtype=dtype, save_latents=save_latents, overwrite=overwrite,
        parallel=ParallelArgs.from_options(locals()),
        create_out=not dry_run, where=where,
    )  # fmt: skip
    cfg = replace(cfg, retries=retries)
    err = Console(stderr=True, soft_wrap=True)
    if cfg.hybrid is not None and cfg.hybrid.scaled() and not quiet:
        for n in sorted({i.steps for i in cfg.items} - {50}):
            r = cfg.hybrid.resolved(n)
            err.print(
                f"note: --hybrid defaults are the paper's 50-step values scaled to {n} steps: k {r.k}, "
                f"window {r.window}, slope {r.slope:g}, tau cap {r.tau_cap}"
                + (" (k 1: the pipeline window is only its fill step)" if r.k == 1 else ""),
                highlight=False,
            )
    if array > len(cfg.items):
        raise ConfigError(f"--array {array} is more than the {len(cfg.items)} items")
    if dry_run:
        from ditango_cli.dry_run import show_dry_run

        return show_dry_run(cfg, slurm_opts, where, as_json)
    if not quiet and executor == ExecutorChoice.auto and where == "local" and cfg.nodes > 1:
        err.print(f"executor: local ({cfg.nodes} virtual nodes; no sbatch on PATH)", highlight=False)
    if where in ("sbatch", "srun"):
        from ditango_cli.cluster import run_on_slurm

        return run_on_slurm(cfg, slurm_opts, where, wait_for_job, quiet, as_json, err)
    observer = contextlib.nullcontext(SilentObserver()) if quiet else RichObserver(err)
    try:
        with observer as obs:
            if array == 1:
                report = launch(cfg, obs)
            else:  # the Slurm array's sharding, one shard after the other
                for task in range(array):
                    shard_cfg = replace(cfg, items=tuple(shard(cfg.items, task, array)))
                    launch(shard_cfg, obs, report_name=f"report.task-{task}.json")
                report = aggregate(cfg.out_dir)
    except RankFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        return EXIT_FAILED_ITEMS
    return report_summary(report, cfg.out_dir / "report.json", quiet, as_json, err)


@app.command()
def check(
    model: ModelOpt = "tiny-wan",
    model_root_dir: ModelRootOpt = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    negative_prompt: NegativeOpt = None,
    seed: SeedOpt = 0,
    steps: StepsOpt = None,
    guidance: GuidanceOpt = None,
    height: HeightOpt = None,
    width: WidthOpt = None,
    frames: FramesOpt = None,
    out: OutOpt = Path("out"),
    dtype: DTypeOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    nodes: NodesOpt = 1,
    gpus_per_node: GpusOpt = 1,
    parallel: ParallelOpt = None,
    ulysses_degree: UlyssesOpt = None,
    executor: ExecutorOpt = ExecutorChoice.auto,
    replicas: ReplicasOpt = 1,
    timeout: TimeoutOpt = 600.0,
    setup_timeout: SetupTimeoutOpt = None,
    attention_backend: BackendOpt = BackendChoice.auto,
    cache_ratio: CacheRatioOpt = None,
    warmup: WarmupOpt = None,
    cooldown: CooldownOpt = None,
    group_size: GroupSizeOpt = None,
    tau_max: TauMaxOpt = None,
    anchor_interval: AnchorIntervalOpt = None,
    alpha: AlphaOpt = None,
    cache_dtype: CacheDtypeOpt = None,
    cache_memory_limit: CacheLimitOpt = None,
    reference: ReferenceOpt = None,
    cfg_parallel: CfgParallelOpt = False,
    hybrid: HybridOpt = False,
    hybrid_k: HybridKOpt = None,
    hybrid_window: HybridWindowOpt = None,
    hybrid_slope: HybridSlopeOpt = None,
    hybrid_tau_cap: HybridCapOpt = None,
    hybrid_split: HybridSplitOpt = None,
    hybrid_first_text: HybridTextOpt = "cond",
    as_json: JsonOpt = False,
) -> int:
    """Validate a would-be `generate` (model directory, prompts, sizes, output) without loading weights."""
    from slurm.options import SlurmOptions, choose_executor

    overrides = Overrides(negative_prompt, seed, height, width, frames, steps, guidance)
    where = choose_executor(executor.value, nodes, SlurmOptions())
    cfg, resolved = build_run_config(
        model=model, model_root_dir=model_root_dir, prompt=prompt, prompts=prompts, overrides=overrides,
        out=out, device=device, dtype=dtype, create_out=False,
        parallel=ParallelArgs.from_options(locals()), where=where,
    )  # fmt: skip
    from runtime.run import plan_resume

    placement = placement_on(torch.device(cfg.device), cfg.dtype)
    skipped = plan_resume(cfg) if cfg.out_dir.is_dir() else {}
    spec = resolved.spec
    summary = {
        "model": cfg.model,
        "model_path": None if resolved.path is None else str(resolved.path),
        "transformer": {"params": spec.params, "heads": spec.heads, "layers": spec.layers, "head_dim": spec.head_dim},
        "device": str(placement.device),
        "dtype": placement.dtype_name,
        "out_dir": str(cfg.out_dir),
        "layout": cfg.layout.to_json(),
        "replicas": cfg.replicas,
        "executor": where,
        "attention_backend": "diffusers"
        if cfg.layout.strategy == "none"
        else resolve_backend(cfg.attention_backend, placement.device, placement.dtype, check_installed=where == "local"),
        "skipped": sorted(skipped),
        "items": [
            {
                "id": i.id, "prompt": i.prompt, "negative_prompt": i.negative_prompt, "seed": i.seed,
                "height": i.height, "width": i.width, "frames": i.frames, "steps": i.steps,
                "guidance": i.guidance, "tokens": i.tokens(),
            }
            for i in cfg.items
        ],
    }  # fmt: skip
    if as_json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
        return 0
    console = Console()
    console.print(
        f"model {summary['model']} ({summary['model_path'] or 'built-in'}), {spec.layers} layers, "
        f"{spec.heads} heads; device {summary['device']}, dtype {summary['dtype']}; out {summary['out_dir']}; "
        f"{cfg.layout.world_size} rank(s)"
        + (f" x {cfg.replicas} replicas" if cfg.replicas > 1 else "")
        + f", strategy {cfg.layout.strategy} "
        f"(ulysses {cfg.layout.ulysses} x ring {cfg.layout.ring}, attention {summary['attention_backend']})",
        highlight=False,
    )
    table = Table("id", "prompt", "seed", "size", "frames", "steps", "guidance", "tokens")
    for i in summary["items"]:
        short = i["prompt"] if len(i["prompt"]) <= 48 else i["prompt"][:45] + "..."
        table.add_row(
            i["id"], short, str(i["seed"]), f"{i['width']}x{i['height']}", str(i["frames"]),
            str(i["steps"]), f"{i['guidance']:g}", str(i["tokens"]),
        )  # fmt: skip
    console.print(table)
    todo = len(cfg.items) - len(skipped)
    console.print(f"ok: {todo} item(s) would be generated, {len(skipped)} skipped (outputs exist)", highlight=False)
    return 0


@app.command()
def models(
    model_root_dir: ModelRootOpt = None,
    as_json: JsonOpt = False,
) -> int:
    """List registry names with size, heads, layers and where each resolves."""
    root = model_root(model_root_dir)
    rows = []
    for spec in REGISTRY.values():
        if spec.builtin:
            where = "built-in"
        elif root is None:
            where = f"not configured (set --model-root or {MODEL_ROOT_ENV})"
        else:
            path = root / spec.dir_name
            where = str(path) if path.is_dir() else f"missing: {path}"
        rows.append(
            {"name": spec.name, "params": spec.params, "heads": spec.heads, "layers": spec.layers,
             "head_dim": spec.head_dim, "resolves_to": where, "description": spec.description}
        )  # fmt: skip
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table("name", "params", "heads", "layers", "resolves to")
    for r in rows:
        table.add_row(r["name"], _human(r["params"]), str(r["heads"]), str(r["layers"]), r["resolves_to"])
    Console().print(table)
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
        failed = [r for r in report["items"] if r["status"] == "failed"]
        first = (failed[0].get("error") or "").splitlines()[0] if failed and failed[0].get("error") else "?"
        typer.echo(
            f"error: {len(failed)} item(s) failed: {', '.join(r['id'] for r in failed)} "
            f"(first: {first}; see {report_path})",
            err=True,
        )
        return EXIT_FAILED_ITEMS
    return 0


def _quiet_libraries() -> None:
    """Our progress bar is the only one: hide diffusers'/transformers' loading bars."""
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


# Commands defined in their own modules register themselves on `app` when imported.
from ditango_cli import cluster, simulate  # noqa: E402, F401


def main() -> None:
    app()


if __name__ == "__main__":
    main()
