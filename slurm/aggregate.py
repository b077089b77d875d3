"""`ditango report OUT_DIR`: one report.json for a batch that ran as several array tasks,
requeues or reruns. Items come from their sidecars (the record of a finished item) and,
for items without one, from the latest task report that mentions them (failures)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.report import SCHEMA
from runtime.video import write_json


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def aggregate(out_dir: Path) -> dict:
    loaded = [_load(p) for p in sorted(out_dir.glob("report*.json")) if ".partial-" not in p.name]
    # A previous aggregate is an output, not an input (its items are older than the tasks').
    reports = sorted(
        (r for r in loaded if r is not None and "items" in r and "aggregated_from" not in r),
        key=lambda r: r.get("started_at", ""),
    )
    items: dict[str, dict] = {}
    for report in reports:  # later reports win
        for item in report["items"]:
            items[item["id"]] = item
    for path in out_dir.glob("*.json"):
        record = None if ".partial-" in path.name else _load(path)  # a writer killed mid-write
        # A sidecar is the latest word on its item: every attempt rewrites it (running, then done
        # or failed), while a task report may predate a requeue or retry.
        if (
            record is not None
            and "id" in record
            and record.get("status") in ("done", "failed")
            and "items" not in record
        ):
            items[record["id"]] = record
    ordered = [items[k] for k in sorted(items)]
    counts = {s: sum(i.get("status") == s for i in ordered) for s in ("done", "skipped", "failed")}
    base = reports[-1] if reports else {}
    merged = {
        **{k: v for k, v in base.items() if k not in ("items", "counts")},
        "schema": SCHEMA,
        "aggregated_from": sorted(p.name for p in out_dir.glob("report.task-*.json")),
        "counts": counts,
        "items": ordered,
    }
    write_json(out_dir / "report.json", merged)
    return merged
