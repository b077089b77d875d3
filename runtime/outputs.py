"""The output ledger: what an output folder holds and says about each item.

Paths of an item's files, its sidecar's status ("running" while it is generated, then
"done" or "failed"), which items a rerun skips (resume), which ones a failed launch is to be
blamed for, and the records of failed attempts. The runtime writes through it and the
supervisor (slurm/supervise.py) reads through it; its reads are tolerant (`read_record`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import TEXT_LIMIT, Unreadable, parse_json, read_text
from runtime.config import Item, RunConfig
from runtime.errors import OutputWriteError
from runtime.record_shape import well_formed
from runtime.report import item_record
from runtime.video import write_json

STATE_DIR = ".ditango"  # the tool's bookkeeping in an output folder; no item id starts with "."


def state_dir(out_dir: Path) -> Path:
    """`OUT/.ditango/`: lock, jobs.json, task and replica reports, the file-system clock. Item
    ids start with a letter or digit, so nothing in here can collide with an item's files; its
    presence also marks OUT as an output folder of this tool."""
    return out_dir / STATE_DIR


def require_output_folder(out_dir: Path) -> Path:
    """`out_dir` if it is an output folder of this tool, else a ConfigError (exit 2): commands
    that read and write a batch's bookkeeping (report, status, cancel) touch nothing else."""
    if not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is not a directory")
    if not state_dir(out_dir).is_dir():
        raise ConfigError(f"{out_dir} is not an output folder of ditango (it has no {STATE_DIR}/); nothing was done")
    return out_dir


class Damaged(ConfigError):
    """A file of an output folder that cannot be read back (one line: which file, and why)."""


def read_json(path: Path, what: str = "file"):
    """The JSON value at `path`, None when there is no such file; `Damaged` when it cannot be
    read or is not JSON (not UTF-8, truncated, not a file). Every bookkeeping file of an
    output folder is read back through here or `read_record`."""
    try:
        return parse_json(read_text(path, what, TEXT_LIMIT), what)
    except FileNotFoundError:
        return None
    except Unreadable as exc:  # too large, not text, not JSON, nested beyond reason
        raise Damaged(f"{path}: damaged {what} ({exc.reason})") from None
    except ConfigError as exc:  # not a regular file
        raise Damaged(str(exc)) from None


def check_foreign_files(out_dir: Path) -> None:
    """Refuse an OUT whose report.json this tool did not write (it would be replaced)."""
    report = out_dir / "report.json"
    if report.exists() and read_record(report) is None:
        raise ConfigError(f"{report} is not a report of ditango (or is damaged); move it away or use another --out")


def read_record(path: Path) -> dict | None:
    """The schema-1 record (sidecar or report) at `path`, or None when it is missing, being
    written, damaged (not JSON, not UTF-8, not a record's shape) or of another schema: an item
    whose sidecar reads as None is simply not done. Sidecars and reports are read back here."""
    try:
        data = read_json(path)
    except Damaged:
        return None
    return data if well_formed(data) else None


def output_paths(out_dir: Path, item_id: str) -> dict[str, Path]:
    return {
        "video": out_dir / f"{item_id}.mp4",
        "sidecar": out_dir / f"{item_id}.json",
        "latents": out_dir / f"{item_id}.latents.safetensors",
        "poster": out_dir / f"{item_id}.poster.png",  # the video's middle frame, for report.html
        "steps": out_dir / f"{item_id}.steps.png",  # time and reuse per step
        "exact": out_dir / f"{item_id}.exact.mp4",  # with --reference exact: the exact run's video
    }


RUNNING = "running"  # sidecar status of an item being generated (or whose run died)


def fs_clock(out_dir: Path) -> float:
    """Now, by the output folder's file system clock (the one sidecar mtimes use): compare
    sidecar times with this, not with this host's clock, which may differ on a shared file system."""
    stamp = state_dir(out_dir) / "clock"
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        return stamp.stat().st_mtime
    except OSError as exc:
        raise OutputWriteError.of(stamp, exc) from None


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
    no retry left (given up, possibly inside a process) or for good (`final`)."""
    return {
        i.id: r
        for i, r in _sidecars_since(cfg.items, cfg.out_dir, since)
        if r.get("status") == "done"
        or (r.get("status") == "failed" and (r.get("final") or r.get("attempts", 0) > cfg.retries))
    }


def mark_running(cfg: RunConfig, item: Item) -> None:
    """Replace any old "done" sidecar (it must not outlive a redo) and mark the item in flight:
    after a crash, the supervisor knows which item to blame and retry."""
    record = item_record(
        item, model=cfg.model, status=RUNNING, video=None, latents=None, timing=None, method=video_method(cfg)
    )
    write_json(output_paths(cfg.out_dir, item.id)["sidecar"], record)


def record_failure(cfg: RunConfig, item: Item, error: str, attempts: int, final: bool = False) -> dict:
    """Write (and return) the sidecar of an item whose attempt failed; `final`: a failure that
    would happen again (it is given up at once, whatever retries are left)."""
    record = item_record(
        item,
        model=cfg.model,
        status="failed",
        video=None,
        latents=None,
        timing=None,
        error=error,
        method=video_method(cfg),
    )
    record["attempts"] = attempts
    if final:
        record["final"] = True
    write_json(output_paths(cfg.out_dir, item.id)["sidecar"], record)
    return record


def video_method(cfg: RunConfig) -> dict:
    """What besides an item's own fields shapes its video, as its sidecar keeps it: {} for an
    exact run (every exact strategy makes the same video, up to float rounding); else DiTango's
    options and partitions (the cache ratio a --target-psnr calibration picks is its own),
    Hybridiff's, the step cache's and --quantize's (--compile is not: it changes the float
    rounding only). A tiled decode (the default on several ranks) is not:
    its tiles are blended, a batch may resume on another number of GPUs, and each item's
    `decode` says how it was decoded."""
    method: dict = {}
    d = cfg.ditango
    if cfg.layout.strategy.reuses and d is not None and (d.planner.cache_ratio > 0 or d.target_psnr is not None):
        options = asdict(d)
        # --reuse is not: where reuse pays it changes nothing, and where it does not the item's
        # record says the ring ran (attention.reuse); folders made before the option resume.
        options["planner"].pop("reuse")
        if d.target_psnr is not None:
            options["planner"].pop("cache_ratio")
        method["ditango"] = {**options, "layout": cfg.layout.to_json()}
    if cfg.hybrid is not None:
        method["hybrid"] = asdict(cfg.hybrid)
    if cfg.step_cache is not None:
        method["step_cache"] = cfg.step_cache.to_json()
    if cfg.quantize != "none":
        method["quantize"] = cfg.quantize
    return json.loads(json.dumps(method, default=str))  # as it reads back from the sidecar


def damaged_sidecars(cfg: RunConfig) -> list[str]:
    """A line per item whose sidecar is there but cannot be read back (not UTF-8, not JSON,
    not a record's shape): such an item is not done, so the run generates it again."""
    lines = []
    for item in cfg.items:
        path = output_paths(cfg.out_dir, item.id)["sidecar"]
        if not path.exists() or read_record(path) is not None:
            continue
        try:
            read_json(path, "sidecar")
            why = f"{path}: not a sidecar of ditango (of another shape or schema)"
        except Damaged as exc:
            why = str(exc)
        lines.append(f"note: {why}; {item.id} is generated again")
    return lines


def item_status(cfg: RunConfig, item: Item) -> str | None:
    """The status its sidecar gives an item (None: no readable sidecar)."""
    return (read_record(output_paths(cfg.out_dir, item.id)["sidecar"]) or {}).get("status")


def progress_line(cfg: RunConfig, states: list[str]) -> str:
    """'  RUNNING: 3/8 items done, 1 running': a batch's job states and its items' counts."""
    status = [item_status(cfg, item) for item in cfg.items]
    return (
        f"  {', '.join(states)}: {status.count('done')}/{len(cfg.items)} items done"
        + (f", {status.count(RUNNING)} running" if RUNNING in status else "")
        + (f", {status.count('failed')} failed" if "failed" in status else "")
    )


def status_counts(out_dir: Path, alive: bool = True, held: frozenset[str] = frozenset()) -> str:
    """'5 done, 1 running': the item sidecars of `out_dir` by status (done always shown), the
    items a queue's lease holds (`held`, runtime/queue_status.py) running unless done. Not
    `alive` (no job and no process works on the folder): a running item was interrupted."""
    counts: dict[str, int] = {}
    seen = set()
    for _, record in item_records(out_dir):
        seen.add(record.get("id"))
        status = RUNNING if record.get("id") in held and record.get("status") != "done" else record.get("status")
        status = status if status != RUNNING or alive else "interrupted"
        counts[status] = counts.get(status, 0) + 1
    for _ in held - seen:
        status = RUNNING if alive else "interrupted"
        counts[status] = counts.get(status, 0) + 1
    shown = ("done", RUNNING, "interrupted", "failed")
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in shown if counts.get(s) or s == "done")


def item_records(out_dir: Path):
    """(path, record) of every readable item sidecar in `out_dir` (not reports, not partial files)."""
    for path in sorted(out_dir.glob("*.json")):
        record = None if path.name.startswith(".") else read_record(path)
        if record is not None and "id" in record and "items" not in record:
            yield path, record
