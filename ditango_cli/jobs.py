"""`ditango status`, `cancel` and `report`: a batch's Slurm jobs and its aggregated report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.errors import ConfigError

OutArg = Annotated[Path, typer.Argument(help="The --out folder of a batch.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def status(out: OutArg) -> int:
    """State of the Slurm jobs submitted for OUT and of its items."""
    from runtime.outputs import item_records
    from slurm.submit import failed_state, job_states

    rows = job_states(out)
    table = Table("job", "state", "submitted", "error")
    for r in rows:
        table.add_row(r["job_id"], r["state"], r["submitted_at"], escape(r["error"] or ""))
    Console().print(table)
    counts: dict[str, int] = {}
    for _, record in item_records(out):
        counts[record.get("status")] = counts.get(record.get("status"), 0) + 1
    parts = [f"{counts.get(s, 0)} {s}" for s in ("done", "running", "failed") if counts.get(s) or s == "done"]
    Console().print(f"items in {out}: {', '.join(parts)}", highlight=False)
    # Earlier submissions of a retried batch may have failed; the latest one says how it stands.
    latest = max((r["submitted_at"] for r in rows), default=None)
    return 1 if any(failed_state(r["state"]) for r in rows if r["submitted_at"] == latest) else 0


def cancel(out: OutArg) -> int:
    """Cancel every Slurm job submitted for OUT (finished items stay; a rerun resumes)."""
    from slurm.submit import cancel as cancel_jobs

    ids = cancel_jobs(out)
    typer.echo(f"cancelled {', '.join(ids) if ids else 'nothing'}")
    return 0


def report(out: OutArg, as_json: JsonOpt = False) -> int:
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
