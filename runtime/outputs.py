"""The output ledger: what an output folder holds and says about each item.

Paths of an item's files, its sidecar's status ("running" while it is generated, then
"done" or "failed"), which items a rerun skips (resume), which ones a failed launch is to be
blamed for, and the records of failed attempts. The runtime writes through it and the
supervisor (slurm/supervise.py) reads through it; its reads are tolerant (`read_record`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from planner.errors import ConfigError
from runtime.config import Item, RunConfig
from runtime.report import SCHEMA, item_record
from runtime.video import write_json


def read_record(path: Path) -> dict | None:
    """The schema-1 record (sidecar or report) at `path`, or None when it is missing, being
    written, damaged (not JSON, not UTF-8) or of another schema. Sidecars and reports are read
    back through here."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    return data


def output_paths(out_dir: Path, item_id: str) -> dict[str, Path]:
    return {
        "video": out_dir / f"{item_id}.mp4",
        "sidecar": out_dir / f"{item_id}.json",
        "latents": out_dir / f"{item_id}.latents.safetensors",
    }


RUNNING = "running"  # sidecar status of an item being generated (or whose run died)


def fs_clock(out_dir: Path) -> float:
    """Now, by the output folder's file system clock (the one sidecar mtimes use): compare
    sidecar times with this, not with this host's clock, which may differ on a shared file system."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / ".ditango-clock"
    stamp.touch()
    return stamp.stat().st_mtime


def _sidecars_since(items, out_dir: Path, since: float):
    for item in items:
        path = output_paths(out_dir, item.id)["sidecar"]
        record = read_record(path)
        if record is not None:
            try:
                if path.stat().st_mtime >= since:
                    yield item, record
            except FileNotFoundError:  # replaced between the read and the stat
                continue


def running_items(cfg: RunConfig, since: float, items=None) -> list[Item]:
    """Items (of `items`, default all) marked in flight at or after `since`: after a failed
    launch that started at `since`, the ones to blame. Older markers (a run killed earlier)
    blame nobody: that item simply runs again."""
    return [
        i
        for i, r in _sidecars_since(cfg.items if items is None else items, cfg.out_dir, since)
        if r.get("status") == RUNNING
    ]


def settled_since(cfg: RunConfig, since: float) -> dict[str, dict]:
    """Records of the items settled at or after `since` (by `fs_clock`): done, or failed with
    no retry left (given up, possibly inside a process)."""
    return {
        i.id: r
        for i, r in _sidecars_since(cfg.items, cfg.out_dir, since)
        if r.get("status") == "done" or (r.get("status") == "failed" and r.get("attempts", 0) > cfg.retries)
    }


def mark_running(cfg: RunConfig, item: Item) -> None:
    """Replace any old "done" sidecar (it must not outlive a redo) and mark the item in flight:
    after a crash, the supervisor knows which item to blame and retry."""
    record = item_record(item, model=cfg.model, status=RUNNING, video=None, latents=None, timing=None)
    write_json(output_paths(cfg.out_dir, item.id)["sidecar"], record)


def record_failure(cfg: RunConfig, item: Item, error: str, attempts: int) -> dict:
    """Write (and return) the sidecar of an item whose attempt failed."""
    record = item_record(item, model=cfg.model, status="failed", video=None, latents=None, timing=None, error=error)
    record["attempts"] = attempts
    write_json(output_paths(cfg.out_dir, item.id)["sidecar"], record)
    return record


# What must match for an existing output to count as this item's (the layout may differ:
# exact strategies produce the same video).
RESUME_KEYS = ("model", "prompt", "negative_prompt", "seed", "height", "width", "frames", "steps", "guidance")


def completed_record(cfg: RunConfig, item: Item) -> dict | None:
    """The sidecar of this item if its outputs are complete, else None.

    Complete: MP4 and a "done" sidecar exist (and the latents file when asked for).
    Outputs made with other settings raise instead of being skipped or overwritten.
    """
    paths = output_paths(cfg.out_dir, item.id)
    record = read_record(paths["sidecar"])
    if record is None or record.get("status") != "done" or not paths["video"].is_file():
        return None
    wanted = {"model": cfg.model, **{k: getattr(item, k) for k in RESUME_KEYS if k != "model"}}
    differ = [k for k in RESUME_KEYS if record.get(k) != wanted[k]]
    if differ:
        k = differ[0]
        raise ConfigError(
            f"{item.source}: {paths['video']} exists but was made with {k} {record.get(k)!r}, not {wanted[k]!r}; "
            "use --overwrite to replace it, or another --out"
        )
    if cfg.save_latents and not paths["latents"].is_file():
        return None
    return record


def plan_resume(cfg: RunConfig) -> dict[str, dict]:
    """{item id: existing record} for the items a run will skip (none with `overwrite`)."""
    if cfg.overwrite:
        return {}
    done = {}
    for item in cfg.items:
        record = completed_record(cfg, item)
        if record is not None:
            done[item.id] = {**record, "status": "skipped"}
    return done


def item_status(cfg: RunConfig, item: Item) -> str | None:
    """The status its sidecar gives an item (None: no readable sidecar)."""
    return (read_record(output_paths(cfg.out_dir, item.id)["sidecar"]) or {}).get("status")


def item_records(out_dir: Path):
    """(path, record) of every readable item sidecar in `out_dir` (not reports, not partial files)."""
    for path in sorted(out_dir.glob("*.json")):
        record = None if ".partial-" in path.name else read_record(path)
        if record is not None and "id" in record and "items" not in record:
            yield path, record


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
