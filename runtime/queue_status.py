"""What `ditango status OUT` says of a batch's queue (runtime/batch_queue.py): each worker, the
item it holds and its lease's age, the items left, and an ETA for the batch.

The ETA is the cost model's price of what is left, scaled by how the items made so far compare
with their prices (claim to publication), shared by the workers alive now; until an item is
done there is no scale, and no ETA."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from runtime.batch_queue import BatchQueue, manifest_path
from runtime.queue_files import fs_now, numbered, read_json_file


def _seconds(a: str, b: str) -> float | None:
    try:
        return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()
    except (TypeError, ValueError):
        return None


def queue_view(out_dir: Path) -> dict | None:
    """The queue of `out_dir`'s batch as `status` shows it; None without one (--queue static,
    or a folder made before the queue)."""
    manifest = read_json_file(manifest_path(out_dir))
    if manifest is None or not isinstance(manifest.get("batch"), str) or not isinstance(manifest.get("items"), list):
        return None
    try:
        queue = BatchQueue(out_dir, manifest)
    except (KeyError, TypeError, ValueError):
        return None
    if not queue.root.is_dir():
        return None
    now = fs_now(queue.root)
    states = {item: queue.state(item, now) for item in queue.order}
    prices = {e["id"]: float(e.get("price_s") or 0) for e in manifest["items"] if isinstance(e, dict) and "id" in e}
    workers = []
    for path in sorted((queue.root / "workers").glob("*.json")):
        data = read_json_file(path)
        if data is None:
            continue
        age = now - path.stat().st_mtime
        item = data.get("item")
        lease = states.get(item) if isinstance(item, str) else None
        alive = data.get("state") in ("working", "idle", "lost") and age <= queue.lease_s
        workers.append(
            {
                "worker": data.get("label") or data.get("worker"),
                "host": data.get("host"),
                "pid": data.get("pid"),
                "state": data.get("state") if alive or data.get("state") == "finished" else "gone",
                "item": item,
                "lease_age_s": None if lease is None or lease.kind != "leased" else round(lease.age_s, 1),
                "done": data.get("done", 0),
                "failed": data.get("failed", 0),
            }
        )
    counts = {k: sum(s.kind == k for s in states.values()) for k in ("done", "failed", "leased", "pending")}
    left = [i for i, s in states.items() if s.kind not in ("done", "failed")]
    return {
        "batch": queue.batch,
        "lease_s": queue.lease_s,
        "items": len(queue.order),
        "left": len(left),
        "counts": {**counts, "to retry": sum(s.kind in ("retry", "expired") for s in states.values())},
        "workers": workers,
        "eta_s": eta(queue, states, prices, left, sum(w["state"] in ("working", "idle") for w in workers)),
    }


def eta(queue: BatchQueue, states: dict, prices: dict, left: list[str], alive: int) -> float | None:
    """Seconds until the batch is done at the pace so far (None: no item done yet, or no worker)."""
    if not left:
        return 0.0
    made = priced = 0.0
    for item, st in states.items():
        if st.kind != "done":
            continue
        lease = read_json_file(queue.item_dir(item) / str(st.data.get("lease"))) or {}
        took = _seconds(lease.get("at"), st.data.get("at"))
        if took is not None and prices.get(item):
            made, priced = made + took, priced + prices[item]
    if not priced or not alive:
        return None
    return made / priced * sum(prices.get(i, 0.0) for i in left) / alive


def queue_lines(view: dict) -> list[str]:
    """The queue in a few lines of text."""
    c = view["counts"]
    eta_text = "" if view["eta_s"] is None else f", ETA batch {view['eta_s']:.0f} s"
    lines = [
        f"queue: {view['items']} item(s), {view['left']} left ({c['leased']} held, {c['pending']} waiting, "
        f"{c['to retry']} to retry), {c['done']} done, {c['failed']} failed{eta_text}"
    ]
    for w in view["workers"]:
        holding = (
            f"item {w['item']} (lease {w['lease_age_s']:.0f} s old)" if w["lease_age_s"] is not None else "no item"
        )
        lines.append(
            f"  worker {w['worker']} (pid {w['pid']} on {w['host']}): {w['state']}, {holding}, "
            f"{w['done']} done, {w['failed']} failed"
        )
    return lines


def history(queue: BatchQueue, item: str) -> list[dict]:
    """An item's history files in order (for the report's and the tests' eyes)."""
    folder = queue.item_dir(item)
    return [read_json_file(folder / str(n)) or {} for n in numbered(folder)]


def queue_summary(out_dir: Path, batch: str | None) -> dict | None:
    """What a report says of the queue of batch `batch`: its workers (each with what it made and
    how it ended) and the late files it discarded (None: no queue, or another batch's)."""
    if batch is None:
        return None
    manifest = read_json_file(manifest_path(out_dir))
    if manifest is None or manifest.get("batch") != batch:
        return None
    root = BatchQueue(out_dir, manifest).root
    workers = [read_json_file(p) or {} for p in sorted((root / "workers").glob("*.json"))]
    discarded = [read_json_file(p) or {} for p in sorted((root / "discarded").glob("*.json"))]
    return {
        "batch": batch,
        "lease_s": manifest.get("lease_s"),
        "workers": [
            {k: w.get(k) for k in ("label", "worker", "host", "pid", "launch", "job", "state", "done", "failed")}
            for w in workers
        ],
        "discarded": [d.get("line") for d in discarded],
    }


def held_items(out_dir: Path) -> frozenset[str]:
    """The items whose last word in the folder's batch is a lease: in flight, or interrupted."""
    manifest = read_json_file(manifest_path(out_dir))
    if manifest is None or not isinstance(manifest.get("batch"), str) or not isinstance(manifest.get("items"), list):
        return frozenset()
    try:
        queue = BatchQueue(out_dir, manifest)
    except (KeyError, TypeError, ValueError):
        return frozenset()
    return frozenset(lease.item for lease in queue.leases_of(lambda data: True))
