"""Slurm-facing commands: submit-and-wait for `generate`, `status`, `cancel`, `report`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ditango_cli.app import EXIT_FAILED_ITEMS, app, report_summary
from ditango_cli.options import JsonOpt
from runtime.errors import ConfigError


def run_on_slurm(cfg, opts, where: str, wait_for_job: bool, quiet: bool, as_json: bool, err: Console) -> int:
    """`sbatch`: submit, then (with --wait) follow the job; `srun`: run job steps in the current
    allocation. A failed item is retried in a new submission / step of the array tasks that
    still have work; a cancelled job is final."""
    from runtime.run import RUNNING, fs_clock, settled_since
    from slurm.aggregate import aggregate
    from slurm.allocation import run_steps
    from slurm.launch import blame, share_of_rank
    from slurm.sharding import shard
    from slurm.submit import submit, wait

    attempts: dict[str, int] = {}
    given_up: dict[str, dict] = {}
    since = fs_clock(cfg.out_dir)
    tasks = list(range(opts.array))

    def show(states):
        nonlocal last
        status = [_status(cfg, i) for i in cfg.items]
        line = (
            f"  {', '.join(states)}: {status.count('done')}/{len(cfg.items)} items done"
            + (f", {status.count(RUNNING)} running" if RUNNING in status else "")
            + (f", {status.count('failed')} failed" if "failed" in status else "")
        )
        if not quiet and line != last:
            err.print(line, highlight=False)
            last = line

    while True:
        last = None
        decided = {**settled_since(cfg, since), **given_up}  # from earlier submissions of this call
        attempt = fs_clock(cfg.out_dir)
        if where == "srun":
            if not quiet:
                err.print(f"executor: srun in allocation {os.environ.get('SLURM_JOB_ID')}", highlight=False)
            failures = run_steps(cfg, opts, decided, show, tasks=tasks)
            names = [f"step {t}" for t in tasks]
            cancelled = [False] * len(tasks)
        else:
            jobs = submit(cfg, opts, decided, tasks)
            ids = [j.job_id for j in jobs]
            if not wait_for_job:
                typer.echo(f"submitted job(s) {', '.join(ids)}; follow with: ditango status {cfg.out_dir}")
                return 0
            if not quiet:
                err.print(
                    f"submitted job(s) {', '.join(ids)}; waiting (Ctrl-C stops waiting, not the job)", highlight=False
                )
            failures = wait(jobs, show)
            names = [f"job {j}" for j in ids]
            cancelled = [j.state.startswith("CANCELLED") for j in jobs]
        failed = [
            (t, name, e, rank, c) for t, name, (e, rank), c in zip(tasks, names, failures, cancelled, strict=True) if e
        ]
        if not failed:
            break
        if any(c for *_, c in failed):
            for _, name, error, _, c in failed:
                typer.echo(f"error: {name} {'was cancelled' if c else 'failed'}: {error}", err=True)
            aggregate(cfg.out_dir)
            return EXIT_FAILED_ITEMS
        lines = []
        for t, name, error, rank, _ in failed:  # each task's own error, on that task's (replica's) items
            share = share_of_rank(cfg, rank, t, opts.array)
            lines += blame(cfg, f"{name}: {error}", attempts, given_up, attempt, share)
        if not lines:  # a failure outside any item (e.g. the model did not load): retrying cannot help
            for _, name, error, _, _ in failed:
                typer.echo(f"error: {name} failed: {error}", err=True)
            aggregate(cfg.out_dir)
            return EXIT_FAILED_ITEMS
        if not quiet:
            for line in lines:
                err.print(line, highlight=False)
        settled = {**settled_since(cfg, since), **given_up}
        tasks = [
            t for t in range(opts.array)
            if any(i.id not in settled and _status(cfg, i) != "done" for i in shard(cfg.items, t, opts.array))
        ]  # fmt: skip
        if not tasks:
            break
    report = aggregate(cfg.out_dir)
    return report_summary(report, cfg.out_dir / "report.json", quiet, as_json, err)


def _status(cfg, item) -> str | None:
    from runtime.report import read_sidecar
    from runtime.run import output_paths

    return (read_sidecar(output_paths(cfg.out_dir, item.id)["sidecar"]) or {}).get("status")


@app.command()
def status(out: Annotated[Path, typer.Argument(help="The --out folder of a submitted batch.")]) -> int:
    """State of the Slurm jobs submitted for OUT and of its items."""
    from slurm.submit import failed_state, job_states

    rows = job_states(out)
    table = Table("job", "state", "submitted", "error")
    for r in rows:
        table.add_row(r["job_id"], r["state"], r["submitted_at"], escape(r["error"] or ""))
    Console().print(table)
    from runtime.report import read_sidecar

    counts: dict[str, int] = {}
    for path in out.glob("*.json"):
        record = None if ".partial-" in path.name else read_sidecar(path)
        if record is not None and "id" in record and "items" not in record:
            counts[record.get("status")] = counts.get(record.get("status"), 0) + 1
    parts = [f"{counts.get(s, 0)} {s}" for s in ("done", "running", "failed") if counts.get(s) or s == "done"]
    Console().print(f"items in {out}: {', '.join(parts)}", highlight=False)
    # Earlier submissions of a retried batch may have failed; the latest one says how it stands.
    latest = max((r["submitted_at"] for r in rows), default=None)
    return 1 if any(failed_state(r["state"]) for r in rows if r["submitted_at"] == latest) else 0


@app.command()
def cancel(out: Annotated[Path, typer.Argument(help="The --out folder of a submitted batch.")]) -> int:
    """Cancel every Slurm job submitted for OUT (finished items stay; a rerun resumes)."""
    from slurm.submit import cancel as cancel_jobs

    ids = cancel_jobs(out)
    typer.echo(f"cancelled {', '.join(ids) if ids else 'nothing'}")
    return 0


@app.command()
def report(
    out: Annotated[Path, typer.Argument(help="Output folder of a batch.")],
    as_json: JsonOpt = False,
) -> int:
    """Aggregate a batch's task reports and sidecars into OUT/report.json and print a table."""
    from slurm.aggregate import aggregate

    if not out.is_dir():
        raise ConfigError(f"{out} is not a directory")
    merged = aggregate(out)
    if as_json:
        print(out / "report.json")
        return 0
    table = Table("id", "status", "total (s)", "inter-node MB", "intra-node MB")
    for item in merged["items"]:
        timing, comm = item.get("timing") or {}, item.get("comm") or {}
        table.add_row(
            item["id"], item["status"], f"{timing.get('total_s', 0):.2f}",
            f"{comm.get('inter_node_bytes', 0) / 1e6:.2f}", f"{comm.get('intra_node_bytes', 0) / 1e6:.2f}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    c = merged["counts"]
    console.print(f"{c['done']} done, {c['skipped']} skipped, {c['failed']} failed -> {out / 'report.json'}")
    return 0
