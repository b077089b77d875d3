"""Launch a RunConfig on the ranks its layout asks for.

One rank runs in this process. Several ranks run as local processes (`--executor
local`); `--nodes M` then means M virtual nodes: rank r sits on node r // gpus_per_node,
which is what the byte counters and the topology-aware strategies see. With `--replicas R`
the ranks form R independent process groups, each taking items round-robin. A failed
launch is retried for the items left (`launch`, `blame`). The CLI only ever calls `launch`.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from runtime.comm import Comm
from runtime.config import RunConfig
from runtime.mesh import build_mesh
from runtime.run import (
    Observer,
    RankContext,
    SilentObserver,
    execute,
    fs_clock,
    plan_resume,
    record_failure,
    running_items,
    settled_since,
)
from slurm.aggregate import aggregate
from slurm.local import EventSink, RankFailed, run_ranks
from slurm.rank import current_device, select_device
from slurm.sharding import shard

# Debugging aid and test hook: "RANK:STEP[:ITEM_ID]" makes that rank fail after that
# denoising step (of that item only, when given). With FAULT_ONCE_ENV=FILE it fires once:
# FILE is created when it fires, and an existing FILE disarms it (a transient failure).
# FAULT_KIND_ENV says how: "raise" (default), "hang" (the rank stops answering, as a stuck
# GPU or a wedged node would: its peers must time out) or "exit" (the process dies at once).
FAULT_ENV = "DITANGO_FAULT_INJECT"
FAULT_ONCE_ENV = "DITANGO_FAULT_ONCE"
FAULT_KIND_ENV = "DITANGO_FAULT_KIND"
FAULT_KINDS = ("raise", "hang", "exit")


class FaultHook:
    """The fault injection of FAULT_ENV, driven by the observer calls of one rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.item = rank, None
        raw = os.environ.get(FAULT_ENV)
        self.spec = raw.split(":", 2) if raw else None
        self.once = os.environ.get(FAULT_ONCE_ENV)

    def item_started(self, item) -> None:
        self.item = item.id

    def step_done(self, step: int) -> None:
        if self.spec is None or (int(self.spec[0]), int(self.spec[1])) != (self.rank, step):
            return
        if len(self.spec) == 3 and self.spec[2] != self.item:
            return
        kind = os.environ.get(FAULT_KIND_ENV, "raise")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_KIND_ENV} must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        if self.once:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        if kind == "hang":
            while True:
                time.sleep(60)
        if kind == "exit":
            os._exit(3)
        raise RuntimeError(f"injected fault on rank {self.rank} after step {step} ({FAULT_ENV})")


class _ForwardingObserver:
    """A worker rank's observer: forwards calls to the supervisor (EventSink keeps global rank 0's,
    and other replica leaders' messages), with the fault hook in front."""

    def __init__(self, events: EventSink) -> None:
        self.events, self.fault = events, FaultHook(events.rank)

    def run_started(self, total):
        self.events.emit("run_started", total)

    def item_started(self, item):
        self.fault.item_started(item)
        self.events.emit("item_started", item)

    def step_done(self, step, steps):
        self.fault.step_done(step)
        self.events.emit("step_done", step, steps)

    def item_finished(self, record):
        self.events.emit("item_finished", record)

    def message(self, text):
        self.events.emit("message", text)


def replica_share(cfg: RunConfig, replica: int, report_name: str) -> tuple[RunConfig | None, str]:
    """The items (round-robin) and report file of one replica; (None, name) when it gets no item."""
    if cfg.replicas == 1:
        return cfg, report_name
    items = tuple(shard(cfg.items, replica, cfg.replicas))
    name = report_name.removesuffix(".json") + f".replica-{replica}.json"
    return (replace(cfg, items=items) if items else None), name


def node_map(cfg: RunConfig, replica: int) -> tuple[int, ...]:
    """Local runs: global rank g sits on virtual node g // (ranks per node of the allocation)."""
    size = cfg.layout.world_size
    return tuple((replica * size + r) // cfg.gpus_per_node for r in range(size))


def rank_main(
    rank: int,
    world: int,
    events: EventSink,
    cfg: RunConfig,
    skipped: dict,
    report_name: str = "report.json",
    decided: dict | None = None,
) -> dict | None:
    """Entry point of one local rank (after its replica's process group is up)."""
    cfg, report_name = replica_share(cfg, events.replica, report_name)
    if cfg is None:
        return None
    mine = {i.id for i in cfg.items}
    skipped = {k: v for k, v in skipped.items() if k in mine}
    decided = {k: v for k, v in (decided or {}).items() if k in mine}
    mesh = build_mesh(
        cfg.layout, rank, node_map(cfg, events.replica), timeout_s=cfg.timeout_s, device=current_device(),
        control_timeout_s=cfg.setup_timeout_s,
    )  # fmt: skip
    observer = _ForwardingObserver(events)
    ctx = RankContext(mesh, Comm(mesh))
    return execute(cfg, observer, ctx, skipped, report_name=report_name, decided=decided)


def blame(
    cfg: RunConfig,
    error: str,
    attempts: dict[str, int],
    given_up: dict[str, dict],
    since: float,
    items=None,
) -> list[str]:
    """After a launch that started at `since` (fs_clock) failed: record each of `items`
    (default all; the failed replica's or array task's share when known) marked running since
    then as failed, count the attempt and give the item up after `cfg.retries` retries.
    Returns a line per item; empty: nothing to blame (the failure was outside any item)."""
    lines = []
    for item in running_items(cfg, since, items):
        n = attempts[item.id] = attempts.get(item.id, 0) + 1
        record = record_failure(cfg, item, error, n)
        if n > cfg.retries:
            given_up[item.id] = record
            lines.append(f"{item.id} failed ({error}); giving it up after {n} attempt(s)")
        else:
            lines.append(f"{item.id} failed ({error}); retry {n} of {cfg.retries}")
    return lines


def share_of_rank(cfg: RunConfig, rank: int | None, task: int = 0, tasks: int = 1):
    """The items a global rank of array task `task` works on (all of the task's when unknown)."""
    items = tuple(shard(cfg.items, task, tasks))
    if rank is None or cfg.replicas == 1 or not items:
        return items
    share, _ = replica_share(replace(cfg, items=items), rank // cfg.layout.world_size, "")
    return share.items if share is not None else ()


class _FaultingObserver:
    """A single process's observer with the fault hook in front (FAULT_ENV, rank 0)."""

    def __init__(self, observer: Observer | None) -> None:
        self.inner, self.fault = observer or SilentObserver(), FaultHook(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def item_started(self, item):
        self.fault.item_started(item)
        self.inner.item_started(item)

    def step_done(self, step, steps):
        self.fault.step_done(step)
        self.inner.step_done(step, steps)


def launch(cfg: RunConfig, observer: Observer | None = None, report_name: str = "report.json") -> dict:
    """Run `cfg` and return its report (the same dict that is written to report.json).

    Which items are already complete is decided here, before any rank starts. When a rank
    fails, every rank is stopped; the item that was running is retried (or given up after
    `cfg.retries` retries) in a fresh launch, and the other items go on, so one bad item
    never loses the batch. A failure outside any item (e.g. loading the model) raises.
    """
    if cfg.world_size == 1:
        ctx = RankContext.single(cfg, select_device(cfg.device, 0))
        return execute(cfg, _FaultingObserver(observer), ctx, skipped=plan_resume(cfg), report_name=report_name)

    def on_event(kind: str, payload: tuple) -> None:
        if observer is not None:
            getattr(observer, kind)(*payload)

    attempts: dict[str, int] = {}
    given_up: dict[str, dict] = {}
    since = fs_clock(cfg.out_dir)
    while True:
        skipped = plan_resume(cfg)
        decided = {**settled_since(cfg, since), **given_up}  # from earlier launches of this call
        attempt = fs_clock(cfg.out_dir)
        try:
            reports = run_ranks(
                rank_main,
                cfg.world_size,
                (cfg, skipped, report_name, decided),
                timeout_s=cfg.setup_timeout_s,
                device=cfg.device,
                log_dir=cfg.out_dir / "logs",
                on_event=on_event,
                replicas=cfg.replicas,
            )
            return reports[0] if cfg.replicas == 1 else aggregate(cfg.out_dir)
        except RankFailed as exc:
            lines = blame(cfg, str(exc), attempts, given_up, attempt, share_of_rank(cfg, exc.rank))
            if not lines:
                raise
            for line in lines:
                if observer is not None:
                    observer.message(line)
