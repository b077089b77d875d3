"""`ditango report OUT_DIR`: one report.json for a batch that ran as several array tasks,
replicas, requeues or reruns. Items come from their sidecars (the record of a finished item)
and, for items without one, from the latest task report that mentions them (failures). Task
and replica reports live in OUT/.ditango/reports/; report.json and its page, report.html, are the only
files written."""

from __future__ import annotations

from pathlib import Path

from runtime.batch_queue import manifest_path
from runtime.gallery import write_gallery
from runtime.outputs import check_foreign_files, item_records, read_record
from runtime.queue_files import read_json_file
from runtime.queue_status import queue_summary
from runtime.report import SCHEMA, TIMING_SUMS
from runtime.video import write_json
from slurm.supervise import REPORTS


def aggregate(out_dir: Path, write: bool = True) -> dict:
    """The merged report of `out_dir`, written to its report.json (unless not `write`)."""
    target = out_dir / "report.json"
    check_foreign_files(out_dir)
    paths = [target, *sorted(p for p in (out_dir / REPORTS).glob("*.json") if not p.name.startswith("."))]
    loaded = [(read_record(p), p) for p in paths if p.is_file()]
    # A previous aggregate is an output, not an input (its items are older than the tasks').
    reports = sorted(
        ((r, p) for r, p in loaded if r is not None and "items" in r and "aggregated_from" not in r),
        key=lambda rp: rp[0].get("started_at", ""),
    )
    # For each item the newest word wins, by file-system time: the task report that lists it
    # (rewritten after every item), or its sidecar (rewritten by every attempt: running, then
    # done or failed; also by the launcher when it gives an item up after a crash). So an item
    # the latest run skipped stays "skipped", and one finished after its report was last
    # written (a requeue, a retry) shows its sidecar.
    items: dict[str, tuple[dict, float, Path]] = {}
    for report, path in reports:  # later reports win among reports
        when = path.stat().st_mtime
        for item in report["items"]:
            items[item["id"]] = (item, when, path)
    for path, record in item_records(out_dir):
        if record.get("status") not in ("done", "failed"):
            continue
        when = path.stat().st_mtime
        if record["id"] not in items or when >= items[record["id"]][1]:
            items[record["id"]] = (record, when, path)
    # Timing: of the reports some item's newest word comes from (not those a later run of the
    # same folder has superseded item by item, such as an earlier run's other array tasks).
    current = {source for _, _, source in items.values()}
    items = {k: v[0] for k, v in items.items()}
    ordered = [items[k] for k in sorted(items)]
    counts = {s: sum(i.get("status") == s for i in ordered) for s in ("done", "skipped", "failed")}
    # The run-level keys (model, layout, options, calibration...) come from the newest task
    # report; a folder aggregated before keeps those of its previous aggregate.
    previous = [r for r, p in loaded if p == target and r is not None and "aggregated_from" in r]
    base = reports[-1][0] if reports else (previous[0] if previous else {})
    merged = {
        **{k: v for k, v in base.items() if k not in ("items", "counts", "timing")},
        "schema": SCHEMA,
        "aggregated_from": sorted(p.relative_to(out_dir).as_posix() for _, p in reports if p != target),
        "counts": counts,
        "items": ordered,
    }
    timing = merged_timing([(p.relative_to(out_dir).as_posix(), r) for r, p in reports if p in current])
    if timing is None and base.get("timing"):  # a folder aggregated before: its earlier sums
        timing = base["timing"]
    if timing is not None:
        merged["timing"] = timing
    if (queue := queue_summary(out_dir, (read_json_file(manifest_path(out_dir)) or {}).get("batch"))) is not None:
        merged["queue"] = queue
    if write:
        write_json(target, merged)
        write_gallery(out_dir, merged)
    return merged


def merged_timing(reports: list[tuple[str, dict]]) -> dict | None:
    """The `timing` of the reports that have one (reports written before it existed have
    none): each field summed (rank-seconds of the tasks, which may have run side by side),
    and `per_report`, each report's own. None when no report has one."""
    timed = [(name, r["timing"]) for name, r in reports if isinstance(r.get("timing"), dict)]
    if not timed:
        return None
    sums = {k: round(sum(t.get(k) or 0 for _, t in timed), 6) for k in TIMING_SUMS}
    return {**sums, "per_report": dict(timed)}
