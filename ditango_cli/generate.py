"""`ditango generate` and `check`: the options mapped onto a RunConfig (ditango_cli/run_config.py),
handed to the supervisor (slurm/supervise.py) with the executor the run asks for, and rendered."""

from __future__ import annotations

import contextlib
import json
import shlex
import uuid
from dataclasses import replace
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from basics.errors import ConfigError
from ditango_cli.choices import ExecutorChoice
from ditango_cli.command import command
from ditango_cli.generate_options import GenerateArgs
from ditango_cli.options import ParallelArgs, RunOptions
from ditango_cli.requires import Given
from ditango_cli.run_config import build_run_config, slurm_options
from ditango_cli.tables import plain_console, print_tables, say_error
from runtime.config import QueueSpec, RunConfig
from runtime.errors import ModelDirError
from runtime.kernels import passes_attention_mask, resolve_backend
from runtime.models.loading import placement_on, quiet_loading_bars
from slurm.launchers.env import launcher_layout
from slurm.options import SlurmOptions, choose_executor, host_request
from slurm.rank import launched_rank

EXIT_FAILED_ITEMS = 1


@command(GenerateArgs)
def generate(args: RunOptions, run: GenerateArgs, options: dict, given: Given) -> int:
    """Generate one MP4 per prompt, plus a sidecar JSON per item and report.json."""
    try:
        return _generate(args, run, options, given)
    except KeyboardInterrupt:  # typer then exits 130 without a word
        from runtime.outputs import status_counts
        from runtime.queue_status import held_items

        out = args.output.out
        kept = status_counts(out, alive=False, held=held_items(out)) if out.is_dir() else "nothing"
        typer.echo(
            f"interrupted: {args.output.out} keeps what finished ({kept}); the same command resumes the rest", err=True
        )
        raise


def _generate(args: RunOptions, run: GenerateArgs, options: dict, given: Given) -> int:
    from runtime.batch_open import begin_batch, clear_batch
    from runtime.resume import plan_resume
    from slurm.jobs import recorded_job_ids
    from slurm.launchers import executor_for  # the runtime: only when work is asked for
    from slurm.ownership import own_output_folder
    from slurm.supervise import supervise

    quiet_loading_bars()
    opts = slurm_options(args.slurm)
    ranks = args.parallel.nodes * args.parallel.gpus_per_node
    where = choose_executor(
        args.parallel.executor.value, args.parallel.nodes, opts, require_sbatch=not run.dry_run, ranks=ranks
    )
    parallel, launched = launcher_args(args.parallel, where)
    args = replace(args, parallel=parallel)
    if launched is not None and args.model.download:  # every rank would fetch it, on nodes often offline
        raise ConfigError(
            f"--download under a launcher's ranks: fetch the model first, on a host that reaches the Hub "
            f"(ditango download {args.model.model}), into a cache or --model-root the ranks read"
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
        args,
        where=where,
        create_out=not run.dry_run,
        options=options,
        array=opts.array,
        warn=say if run.dry_run else None,
        given=replace(given, say=say),
        queue=run.queue.value,
    )
    cfg = replace(cfg, retries=run.retries, queue=QueueSpec(run.queue.value, run.lease))
    if run.join is not None:
        cfg = joining(cfg, run)
    if note := cfg.layout.idle(own_group(cfg)):
        say(f"note: {note}")
    if cfg.hybrid is not None and cfg.hybrid.scaled():
        for n in sorted({item.steps for item in cfg.items} - {50}):
            h = cfg.hybrid.resolved(n)
            say(
                f"note: --hybrid defaults are the paper's 50-step values scaled to {n} steps: k {h.k}, window "
                f"{h.window}, slope {h.slope:g}, tau cap {h.tau_cap}"
                + (" (k 1: the pipeline window is only its fill step)" if h.k == 1 else "")
            )
    if where == "sbatch":  # a request cut to what the partition's nodes have is said
        from slurm.launchers.sbatch import partition_node

        if note := host_request(cfg, opts, partition_node(opts))[2]:
            say(f"note: {note}")
    if run.dry_run:
        from ditango_cli.dry_run import show_dry_run

        return show_dry_run(cfg, opts, where, args.run.json)
    if launched is not None:
        return run_as_launched(cfg, launched, opts, run, err, say, args.run.json)
    if args.parallel.executor == ExecutorChoice.auto and where == "local" and cfg.nodes > 1:
        say(f"executor: local ({cfg.nodes} virtual nodes; no sbatch on PATH)")
    progress = progress_view(err, run.quiet or where != "local")
    owner = own_output_folder(cfg.out_dir, run.wait_for_lock, say) if run.join is None else contextlib.nullcontext()
    with owner, progress as observer:
        ended = recorded_job_ids(cfg.out_dir)  # the folder is ours: its jobs have ended
        if run.join is None and cfg.queue.mode == "shared":
            cfg = begin_batch(cfg, set(plan_resume(cfg)), uuid.uuid4().hex, options, ended)
        elif run.join is None:
            clear_batch(cfg, ended)
        executor = executor_for(cfg, opts, where, args.slurm.wait, observer, say)
        outcome = supervise(cfg, executor, opts.array, observer.message if where == "local" else say)
    for line in outcome.notes:
        say(f"note: {line}")
    if outcome.submitted:
        typer.echo(
            f"submitted job(s) {', '.join(executor.job_ids)}; follow with: ditango status {shlex.quote(str(cfg.out_dir))}"
        )
        return 0
    if outcome.errors:
        for line in outcome.errors:
            say_error(line)
        if where != "local":
            executor.report()  # what finished is in report.json all the same
        return EXIT_FAILED_ITEMS
    return report_summary(executor.report(), cfg.out_dir / "report.json", run.quiet, args.run.json, err)


def own_group(cfg: RunConfig) -> str:
    """DiTango's --own-group of this run (what its layout note says of a single group)."""
    return "decide" if cfg.ditango is None else cfg.ditango.planner.own_group


def joining(cfg: RunConfig, run: GenerateArgs) -> RunConfig:
    """`--join OUT`: `cfg` (built from OUT's batch options and the command line's) as a worker
    of OUT's batch, or a one-line refusal before anything is written (runtime/batch_open.py)."""
    from runtime.batch_open import check_join, read_batch

    if cfg.out_dir.resolve() != run.join.resolve():
        raise ConfigError(f"--join {run.join} and --out {cfg.out_dir}: a joining worker writes into the batch's folder")
    for flag, on in (("--queue static", cfg.queue.mode != "shared"), ("--overwrite", cfg.overwrite)):
        if on:
            raise ConfigError(f"--join with {flag}: a joining worker takes items from the batch's queue as they are")
    joined = check_join(cfg, read_batch(cfg.out_dir))
    return replace(joined, queue=replace(joined.queue, report=f"join-{uuid.uuid4().hex[:6]}-"))


def progress_view(err: Console, quiet: bool):
    """The observer that shows this process's progress: none (`quiet`), the bar on a terminal,
    plain timestamped lines elsewhere (Slurm, nohup, `| tee`)."""
    from ditango_cli.progress import RichObserver
    from runtime.context import SilentObserver
    from runtime.progress import LogObserver

    if quiet:
        return contextlib.nullcontext(SilentObserver())
    return RichObserver(err) if err.is_terminal else LogObserver()


def launcher_args(parallel: ParallelArgs, where: str) -> tuple[ParallelArgs, object]:
    """Under a launcher's ranks (`where` env): --nodes and --gpus-per-node as its ranks make
    them, and this process's rank (slurm/rank.py LaunchedRank); else as they are, and None."""
    launched = launched_rank() if where == "env" else None
    if launched is None:
        return parallel, None
    if parallel.replicas > 1:
        raise ConfigError(
            "--replicas with a launcher's ranks: start one launcher job per replica (each its own --out), "
            "or use --executor local or slurm"
        )
    nodes, per_node = launcher_layout(launched, parallel.nodes, parallel.gpus_per_node)
    return replace(parallel, nodes=nodes, gpus_per_node=per_node), launched


def run_as_launched(
    cfg: RunConfig, launched, opts: SlurmOptions, run: GenerateArgs, err: Console, say, as_json: bool
) -> int:
    """`generate` as one rank of a launcher's (slurm/launchers/env.py): rank 0 draws progress and sums up."""
    from slurm.launchers.env import LaunchedRankFailed, run_launched

    progress = progress_view(err, run.quiet or not launched.writer)
    try:
        with progress as observer:
            report = run_launched(cfg, launched, opts.array, observer, say)
    except LaunchedRankFailed as exc:
        say_error(str(exc))
        return EXIT_FAILED_ITEMS
    if not launched.writer:
        return 0
    return report_summary(report, cfg.out_dir / "report.json", run.quiet, as_json, err)


@command()
def check(args: RunOptions, options: dict, given: Given) -> int:
    """Validate a would-be `generate` (model directory, prompts, sizes, output) without loading weights."""
    from runtime.resume import plan_resume
    from slurm.ownership import check_output_folder_free

    opts = slurm_options(args.slurm)
    where = choose_executor(
        args.parallel.executor.value, args.parallel.nodes, opts, ranks=args.parallel.nodes * args.parallel.gpus_per_node
    )
    parallel, _ = launcher_args(args.parallel, where)
    try:  # validation downloads nothing: --download is what generate would do
        quiet = replace(args, model=replace(args.model, download=False), parallel=parallel)
        cfg, resolved = build_run_config(quiet, where=where, create_out=False, array=opts.array, given=given)
    except ModelDirError:
        if not args.model.download:
            raise
        raise ConfigError(
            f"{args.model.model} is not here yet: generate --download would download it first, check does not; "
            f"fetch it with: ditango download {args.model.model}"
        ) from None
    placement = placement_on(torch.device(cfg.device), cfg.dtype)
    check_output_folder_free(cfg.out_dir)  # generate would refuse an OUT that another run or live jobs own
    skipped = plan_resume(cfg) if cfg.out_dir.is_dir() else {}
    spec = resolved.spec
    one_rank = cfg.layout.strategy.runtime is None
    masked = one_rank and passes_attention_mask(spec.family)
    backend = resolve_backend(
        cfg.attention_backend, placement.device, placement.dtype, where == "local", one_rank, masked
    )
    summary = {
        "model": cfg.model,
        "model_path": None if resolved.path is None else str(resolved.path),
        "transformer": {
            "params": spec.params,
            "heads": spec.heads,
            "layers": spec.layers,
            "head_dim": spec.head_dim,
            "task": spec.task,
            "experts": spec.variant.experts,
        },
        "device": str(placement.device),
        "dtype": placement.dtype_name,
        "out_dir": str(cfg.out_dir),
        "layout": cfg.layout.to_json(),
        "replicas": cfg.replicas,
        "executor": where,
        "attention_backend": backend,
        "gpu_memory": cfg.gpu_memory,
        "offload": list(cfg.offload),
        "layout_choice": cfg.layout_choice,
        "skipped": sorted(skipped),
        "items": [it.to_json() for it in cfg.items],
    }
    if args.run.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
        return 0
    console = plain_console()
    lay = cfg.layout
    console.print(
        f"model {summary['model']} ({summary['model_path'] or 'built-in'}), {spec.layers} layers, {spec.heads} heads; "
        f"device {summary['device']}, dtype {summary['dtype']}; out {summary['out_dir']}; {lay.world_size} rank(s)"
        + (f" x {cfg.replicas} replicas" if cfg.replicas > 1 else "")
        + f", strategy {lay.strategy} ({lay.strategy.degrees_text(lay)}, attention {backend})",
        highlight=False,
    )
    if note := lay.idle(own_group(cfg)):
        console.print(f"note: {note}", highlight=False)
    table = Table("id", "prompt", "seed", "size", "frames", "steps", "guidance", "tokens")
    for it in summary["items"]:
        short = it["prompt"] if len(it["prompt"]) <= 48 else it["prompt"][:45] + "..."
        table.add_row(
            it["id"],
            short,
            str(it["seed"]),
            f"{it['width']}x{it['height']}",
            str(it["frames"]),
            str(it["steps"]),
            f"{it['guidance']:g}",
            str(it["tokens"]),
        )
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
        ids = ", ".join(rec["id"] for rec in failed)
        line = f"{len(failed)} item(s) failed: {ids} (first: {first}; see {report_path})"
        say_error(line)
        return EXIT_FAILED_ITEMS
    return 0
