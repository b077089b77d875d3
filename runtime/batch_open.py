"""A batch's queue begun, continued or joined (runtime/batch_queue.py for the queue itself).

The command that owns the output folder begins the batch: every item not already made (resume)
goes into `batch.json`, longest first by the cost model's price of each item, with what a
joining worker must agree on: the model, each item as it was read, and the method that shapes
the video (runtime/outputs.py `video_method`). A relaunch of the same command, or a torchrun
restart, goes on with the batch it began (`key`); a new command begins a new one, unless
workers of the old batch still hold live leases (then it is refused: join it instead).
`--join OUT` reads the batch and refuses, before it writes anything, a run that would make
other videos.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from dataclasses import replace

from basics.errors import ConfigError
from runtime.batch_queue import LEASE_S, BatchQueue, manifest_path, now_text, queue_dir
from runtime.config import QueueSpec, RunConfig
from runtime.outputs import video_method
from runtime.queue_files import make_folder, read_json_file, replace_json
from runtime.report import SCHEMA


def item_prices(cfg: RunConfig) -> dict[str, float]:
    """Each item's modelled seconds on one replica of the run's layout (planner/search.py), on
    this machine's GPU profile (h20's without one): only their order matters here."""
    from planner.cost_model import HARDWARE
    from planner.reuse import FALLBACK_GPU
    from planner.search import Problem, item_seconds
    from runtime.models.resolve import resolve_model

    shape = resolve_model(str(cfg.model_path or cfg.model)).spec.shape
    hw, lay = HARDWARE[FALLBACK_GPU], cfg.layout
    priced: dict[tuple, float] = {}
    out = {}
    for item in cfg.items:
        key = (item.size, item.steps, item.cfg_scale)
        if key not in priced:
            try:
                problem = Problem(shape, item.size, item.steps, lay.nodes, lay.gpus_per_node, cfg_scale=item.cfg_scale)
                priced[key] = item_seconds(hw, problem, lay)
            except (ConfigError, ValueError):  # a shape the cost model cannot price: its work, tokens x steps
                priced[key] = float(item.tokens() * item.steps)
        out[item.id] = priced[key]
    return out


def identity(cfg: RunConfig) -> dict:
    """What a worker of the batch must agree on (as it reads back from JSON)."""
    return json.loads(json.dumps({"model": cfg.model, "method": video_method(cfg)}, default=str))


def begin_batch(cfg: RunConfig, skipped: set[str], key: str, options: dict, ended=()) -> RunConfig:
    """`cfg` with the batch it runs (`cfg.queue.batch`): the one `key` began (a relaunch), else a
    new one, items longest first. Raises a one-line ConfigError when workers of another batch
    are still at work in the folder (not counting the leases of Slurm jobs in `ended`)."""
    from planner.batch import longest_first

    old = read_json_file(manifest_path(cfg.out_dir))
    if old is not None and old.get("key") == key and isinstance(old.get("batch"), str):
        return replace(cfg, queue=replace(cfg.queue, batch=old["batch"]))
    if old is not None and isinstance(old.get("batch"), str):
        refuse_if_live(cfg, old, ended)
    prices = item_prices(cfg)
    order = longest_first({i.id: prices[i.id] for i in cfg.items})
    by_id = {i.id: i for i in cfg.items}
    batch = uuid.uuid4().hex[:12]
    manifest = {
        "schema": SCHEMA,
        "batch": batch,
        "key": key,
        "created_at": now_text(),
        "lease_s": cfg.queue.lease_s,
        "retries": cfg.retries,
        **identity(cfg),
        "options": options,
        "items": [
            {"id": i, "price_s": round(prices[i], 6), "skipped": i in skipped, "item": by_id[i].to_json()}
            for i in order
        ],
    }
    folder = queue_dir(cfg.out_dir)
    make_folder(folder / batch)
    replace_json(manifest_path(cfg.out_dir), manifest)
    for stale in folder.iterdir():  # earlier batches' histories: nobody works on them any more
        if stale.is_dir() and stale.name != batch:
            shutil.rmtree(stale, ignore_errors=True)
    return replace(cfg, queue=replace(cfg.queue, batch=batch))


def clear_batch(cfg: RunConfig, ended=()) -> None:
    """Before a --queue static run: the folder's earlier batch goes (nobody could join it any
    more), unless its workers are still at work (refused, as a new batch would be)."""
    old = read_json_file(manifest_path(cfg.out_dir))
    if old is not None and isinstance(old.get("batch"), str):
        refuse_if_live(cfg, old, ended)
    shutil.rmtree(queue_dir(cfg.out_dir), ignore_errors=True)


def refuse_if_live(cfg: RunConfig, manifest: dict, ended=()) -> None:
    """A one-line ConfigError when a worker of another batch holds a live lease in the folder.
    Not counted: the leases of the Slurm jobs in `ended`, and those of this very process (a
    command it ran before, whose failure could not be recorded: a full disk)."""

    def gone(lease: dict) -> bool:
        here = lease.get("host") == socket.gethostname() and lease.get("pid") == os.getpid()
        return here or lease.get("job") in ended

    try:
        live = [(i, d) for i, d in BatchQueue(cfg.out_dir, manifest).live_leases() if not gone(d)]
    except (KeyError, TypeError, ValueError):  # a damaged batch file: nobody can work on it
        return
    if live:
        item, lease = live[0]
        raise ConfigError(
            f"{cfg.out_dir} has {len(live)} worker(s) of an earlier batch at work (e.g. {lease.get('label')}, pid "
            f"{lease.get('pid')} on {lease.get('host')}, item {item}); wait for them, or add workers to that batch "
            f"with --join {cfg.out_dir}"
        )


def read_batch(out_dir) -> dict:
    """The folder's batch, for `--join` and `status`; a one-line ConfigError when there is none."""
    manifest = read_json_file(manifest_path(out_dir))
    if manifest is None or not isinstance(manifest.get("batch"), str) or not isinstance(manifest.get("items"), list):
        raise ConfigError(
            f"{out_dir} has no batch to join (no {manifest_path(out_dir).relative_to(out_dir)}): start it with "
            "`ditango generate`, whose queue other workers can join (not with --queue static)"
        )
    return manifest


def check_join(cfg: RunConfig, manifest: dict) -> RunConfig:
    """`cfg` as a worker of the folder's batch, or a one-line ConfigError naming what differs:
    the model, an item (added, removed or changed since the batch began: its prompt file was
    edited), or the method that shapes the videos."""
    mine, theirs = identity(cfg), {k: manifest.get(k) for k in ("model", "method")}
    for k in ("model", "method"):
        if mine[k] != theirs[k]:
            raise ConfigError(
                f"--join {cfg.out_dir}: its batch is made with {k} {json.dumps(theirs[k])}, this run with "
                f"{json.dumps(mine[k])}; a joining worker must make the batch's videos (nothing was changed)"
            )
    asked = {i.id: json.loads(json.dumps(i.to_json())) for i in cfg.items}
    batch = {e.get("id"): e.get("item") for e in manifest["items"] if isinstance(e, dict)}
    for item_id in sorted(set(asked) | set(batch)):
        mine, theirs = asked.get(item_id), batch.get(item_id)
        if mine == theirs:
            continue
        if mine is None:
            what = f"this run lacks item {item_id} of the batch"
        elif not isinstance(theirs, dict):
            what = f"the batch has no item {item_id}"
        else:
            k = next(k for k in sorted({*mine, *theirs}) if mine.get(k) != theirs.get(k))
            what = f"item {item_id} reads {k} {json.dumps(mine.get(k))} here, {json.dumps(theirs.get(k))} in the batch"
        raise ConfigError(
            f"--join {cfg.out_dir}: {what}; a joining worker must make the batch's videos (nothing was changed)"
        )
    spec = QueueSpec(cfg.queue.mode, float(manifest.get("lease_s", LEASE_S)), manifest["batch"], "", "join-")
    return replace(cfg, queue=spec, retries=int(manifest.get("retries", cfg.retries)))
