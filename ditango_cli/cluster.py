"""Slurm-facing commands: submit-and-wait for `generate`, `status`, `cancel`, `report`."""

from __future__ import annotations

import os
import time
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
    allocation. Failed items are retried in a new submission / step."""
    from runtime.run import RUNNING, settled_since
    from slurm.aggregate import aggregate
    from slurm.allocation import run_steps
    from slurm.launch import blame
    from slurm.submit import submit, wait

    attempts: dict[str, int] = {}
    given_up: dict[str, dict] = {}
    since = time.time()
    while True:
        decided = {**settled_since(cfg, since), **given_up}  # from earlier submissions of this call
        if where == "srun":
            ids = None
            if not quiet:
                err.print(f"executor: srun in allocation {os.environ.get('SLURM_JOB_ID')}", highlight=False)
        else:
            jobs = submit(cfg, opts, decided)
            ids = [j.job_id for j in jobs]
            if not wait_for_job:
                typer.echo(f"submitted job(s) {', '.join(ids)}; follow with: ditango status {cfg.out_dir}")
                return 0
            if not quiet:
                err.print(
                    f"submitted job(s) {', '.join(ids)}; waiting (Ctrl-C stops waiting, not the job)", highlight=False
                )
        last = None

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

        if where == "srun":
            errors = run_steps(cfg, opts, decided, show)
            names = [f"step {t}" for t in range(len(errors))]
        else:
            errors = wait(jobs, show)
            names = [f"job {j}" for j in ids]
        failed = [(name, e) for name, e in zip(names, errors, strict=True) if e]
        if not failed:
            break
        lines = blame(cfg, "; ".join(f"{name}: {e}" for name, e in failed), attempts, given_up)
        if not lines:  # a failure outside any item (e.g. the model did not load): retrying cannot help
            for name, error in failed:
                typer.echo(f"error: {name} failed: {error}", err=True)
            aggregate(cfg.out_dir)
            return EXIT_FAILED_ITEMS
        if not quiet:
            for line in lines:
                err.print(line, highlight=False)
        if all(i.id in given_up or _status(cfg, i) == "done" for i in cfg.items):
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
    sidecars = [p for p in out.glob("*.json") if p.name not in ("jobs.json",) and not p.name.startswith("report")]
    done = sum(1 for p in sidecars if '"status": "done"' in p.read_text(encoding="utf-8"))
    Console().print(f"{done} item(s) done in {out}", highlight=False)
    return 1 if any(failed_state(r["state"]) for r in rows) else 0


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
