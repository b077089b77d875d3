"""`ditango status`, `cancel` and `report`: a batch's Slurm jobs and its aggregated report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from basics.user_files import printable
from ditango_cli.options import PATH
from ditango_cli.tables import plain_console, print_tables, say_error
from planner.strategy import STRATEGIES

OutArg = Annotated[Path, typer.Argument(**PATH, help="The --out folder of a batch.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def status(out: OutArg) -> int:
    """State of the Slurm jobs submitted for OUT, of its items, and of the item being generated
    (its step and ETAs, read from the writer's heartbeat file, with the file's age: an old one
    is a run that stopped). A folder of a local run (no job recorded) shows its items and progress.

    Exit status 1 when a job of the latest submission failed, 2 when OUT is not an output
    folder of ditango, its job record is damaged, or a Slurm command failed."""
    from runtime.lock import FolderBusy, FolderLock
    from runtime.outputs import require_output_folder, status_counts
    from runtime.progress import heartbeat_line, read_progress
    from runtime.queue_status import held_items, queue_lines, queue_view
    from slurm.job_errors import job_states
    from slurm.jobs import ended_state, failed_state, recorded_jobs

    console = plain_console()
    rows = job_states(out) if recorded_jobs(require_output_folder(out)) is not None else []
    if rows:
        table = Table("job", "state", "submitted", "error")
        for r in rows:
            table.add_row(r["job_id"], r["state"], submitted_when(r["submitted_at"]), r["error"] or "")
        print_tables(console, table)
    else:
        console.print(f"no Slurm job is recorded for {out} (a local run)", highlight=False, soft_wrap=True)
    try:  # an item marked running with no live job and no live owner of OUT was interrupted
        FolderLock(out).check_free()
        alive = any(not ended_state(r["state"]) for r in rows)
    except FolderBusy:
        alive = True
    counts = status_counts(out, alive, held_items(out))
    resume = "; the same command resumes the interrupted" if "interrupted" in counts else ""
    console.print(f"items in {out}: {counts}{resume}", highlight=False, soft_wrap=True)
    report = out / "report.json"
    merged = not alive and merge_if_ended(out, rows)
    if report.is_file():
        now = " (merged now: every job has ended)" if merged else ""
        console.print(f"report: {report}{now}", highlight=False, soft_wrap=True)
    elif rows:
        console.print(
            f"report: none yet; `ditango report {out}` merges what the jobs have written",
            highlight=False,
            soft_wrap=True,
        )
    view = queue_view(out)
    for line in queue_lines(view) if view is not None else ():
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    beats = read_progress(out)
    for name, beat in beats:
        label = f"progress ({name})" if len(beats) > 1 else "progress"
        console.print(f"{label}: {heartbeat_line(beat)}", highlight=False, markup=False, soft_wrap=True)
    # Earlier submissions of a retried batch may have failed; the latest one says how it stands.
    latest = max((r["submitted_at"] for r in rows), default=None)
    failed = [r for r in rows if r["submitted_at"] == latest and failed_state(r["state"]) and not r["cancelled"]]
    return 1 if failed else 0


def merge_if_ended(out: Path, rows: list[dict]) -> bool:
    """After jobs submitted without --wait have all ended (no live job, no live owner of OUT):
    merge their task reports into report.json, as `ditango report` does, when it is missing or
    older than one of them. Whether it merged (not where nothing was submitted, no task wrote a
    report, or the folder cannot be written)."""
    from runtime.errors import OutputWriteError
    from slurm.aggregate import aggregate
    from slurm.supervise import REPORTS

    written = [p.stat().st_mtime for p in (out / REPORTS).glob("*.json") if p.is_file()] if rows else []
    report = out / "report.json"
    if not written or (report.is_file() and report.stat().st_mtime >= max(written)):
        return False
    try:
        aggregate(out)
    except OutputWriteError:  # a read-only folder: `ditango report` shows it without saving
        return False
    return True


def cancel(out: OutArg) -> int:
    """Cancel the live Slurm jobs submitted for OUT (finished items stay; a rerun resumes).

    Waits up to a minute for the cancelled jobs to end, so that a rerun can start at once. One
    line per job: cancelled (and the state it was in), already ended (its final state), or
    unknown to Slurm. Exit status 0 when a job was cancelled, 1 when none was live (nothing
    to cancel), 2 when OUT is not an output folder of ditango, nothing was submitted from it,
    its job record is damaged, or a Slurm command failed (then nothing is cancelled, unless
    scancel itself failed)."""
    from runtime.outputs import require_output_folder
    from slurm.jobs import CANCEL_WAIT_S
    from slurm.jobs import cancel as cancel_jobs

    outcomes = cancel_jobs(require_output_folder(out))
    if not outcomes:
        typer.echo(printable(f"no job is recorded for {out}: nothing to cancel", one_line=True))
    for job_id, outcome, state in outcomes:
        said = {
            "cancelled": f"cancelled (was {state})",
            "ending": f"cancelled, but still {state} after {CANCEL_WAIT_S:g} s",
            "ended": f"already ended ({state})",
        }
        typer.echo(printable(f"job {job_id}: {said.get(outcome, 'unknown to Slurm')}", one_line=True))
    return 0 if any(outcome in ("cancelled", "ending") for _, outcome, _ in outcomes) else 1


def calibration_line(c: dict) -> str:
    """What --target-psnr chose, in one line."""
    measured = c["calibrated_psnr"]
    if c["cache_ratio"] == 0:
        found = "exact attention: no trial reached the target"
    else:
        found = ("identical frames" if measured is None else f"{measured:.2f} dB") + f" on {c['item']}"
    again = len(c.get("recalibrated", []))
    return (
        f"--target-psnr {c['target_psnr']:g}: cache ratio {c['cache_ratio']:g} ({c['planner']} planner), "
        f"{found} ({len(c['trials'])} trials" + (f"; lowered {again} time(s) for items below it)" if again else ")")
    )


def report(out: OutArg, as_json: JsonOpt = False) -> int:
    """Aggregate a batch's task reports and sidecars into OUT/report.json and print a table."""
    from runtime.errors import OutputWriteError
    from runtime.gallery import write_gallery
    from runtime.outputs import require_output_folder
    from runtime.video import write_json
    from slurm.aggregate import aggregate

    merged = aggregate(require_output_folder(out), write=False)
    try:
        write_json(out / "report.json", merged)
        write_gallery(out, merged)
    except OutputWriteError as exc:  # a read-only folder: the report is shown all the same
        unsaved = exc
    else:
        unsaved = None
    if as_json:
        if unsaved is not None:
            raise unsaved
        print(out / "report.json")
        return 0
    cached = any(item.get("step_cache") for item in merged["items"])
    columns = ["id", "status", "total (s)", "inter-node MB", "intra-node MB", "computed (all steps)", "PSNR (dB)"]
    table = Table(*columns, *(["blocks run", "steps skipped"] if cached else []))
    for item in merged["items"]:
        timing, comm = item.get("timing") or {}, item.get("comm") or {}
        computed = (item.get("attention") or {}).get("computed_fraction_all_steps")
        quality = item.get("quality") or {}
        cache = item.get("step_cache") or {}
        skipped = cache.get("skipped_steps", {}).get("cond")
        table.add_row(
            item["id"],
            item["status"],
            f"{timing.get('total_s', 0):.2f}",
            f"{comm.get('inter_node_bytes', 0) / 1e6:.2f}",
            f"{comm.get('intra_node_bytes', 0) / 1e6:.2f}",
            "-" if computed is None else f"{computed:.3f}",
            "-" if not quality else ("identical" if quality.get("psnr") is None else f"{quality['psnr']:.2f}"),
            *(
                [f"{cache['block_fraction']:.3f}" if cache else "-", "-" if skipped is None else str(len(skipped))]
                if cached
                else []
            ),
        )
    console = plain_console()
    layout = merged.get("layout") or {}
    if layout:
        name = layout.get("strategy")
        known = STRATEGIES.get(name) if isinstance(name, str) else None  # a damaged report's may be anything
        group = f", group size {layout.get('group_size')}" if known and "group_size" in known.options else ""
        console.print(
            f"{merged.get('model')}: {layout.get('world_size')} rank(s) on {layout.get('nodes')} node(s), "
            f"strategy {layout.get('strategy')}{group}",
            highlight=False,
            soft_wrap=True,
        )
    print_tables(console, table)
    if merged.get("calibration"):
        console.print(calibration_line(merged["calibration"]))
    c = merged["counts"]
    saved = f" -> {out / 'report.json'}" if unsaved is None else ""
    console.print(f"{c['done']} done, {c['skipped']} skipped, {c['failed']} failed{saved}")
    if unsaved is not None:
        say_error(str(unsaved))
        return 1
    return 0


def submitted_when(stamp: str) -> str:
    """'20260101T093000123456' (a submission folder's name, UTC) -> '2026-01-01 09:30:00 UTC'."""
    from datetime import datetime

    try:
        return f"{datetime.strptime(stamp, '%Y%m%dT%H%M%S%f'):%Y-%m-%d %H:%M:%S} UTC"
    except (TypeError, ValueError):
        return str(stamp)
