"""Launch a RunConfig on the ranks its layout asks for.

One rank runs in this process. Several ranks run as local processes (`--executor
local`); `--nodes M` then means M virtual nodes: rank r sits on node r // gpus_per_node,
which is what the byte counters and the topology-aware strategies see. The CLI only
ever calls `launch`.
"""

from __future__ import annotations

import os

import torch

from runtime.comm import Comm
from runtime.config import RunConfig
from runtime.mesh import build_mesh, virtual_node_map
from runtime.run import Observer, RankContext, execute, plan_resume
from slurm.local import EventSink, run_ranks

# Debugging aid and test hook: "RANK:STEP" makes that rank raise after that denoising step.
FAULT_ENV = "DITANGO_FAULT_INJECT"


class _ForwardingObserver:
    """Rank 0's observer inside a worker: forwards every call to the supervisor."""

    def __init__(self, events: EventSink, fault: tuple[int, int] | None) -> None:
        self.events, self.fault = events, fault

    def run_started(self, total):
        self.events.emit("run_started", total)

    def item_started(self, item):
        self.events.emit("item_started", item)

    def step_done(self, step, steps):
        if self.fault is not None and self.fault == (self.events.rank, step):
            raise RuntimeError(f"injected fault on rank {self.events.rank} after step {step} ({FAULT_ENV})")
        self.events.emit("step_done", step, steps)

    def item_finished(self, record):
        self.events.emit("item_finished", record)

    def message(self, text):
        self.events.emit("message", text)


def _parse_fault() -> tuple[int, int] | None:
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    rank, step = raw.split(":")
    return int(rank), int(step)


def rank_main(
    rank: int, world: int, events: EventSink, cfg: RunConfig, skipped: dict, report_name: str = "report.json"
) -> dict | None:
    """Entry point of one local rank (after the process group is up)."""
    mesh = build_mesh(cfg.layout, rank, virtual_node_map(cfg.layout), timeout_s=cfg.timeout_s)
    observer = _ForwardingObserver(events, _parse_fault())
    return execute(cfg, observer, RankContext(mesh, Comm(mesh)), skipped, report_name=report_name)


def launch(cfg: RunConfig, observer: Observer | None = None, report_name: str = "report.json") -> dict:
    """Run `cfg` and return its report (the same dict that is written to report.json).

    Which items are already complete is decided here, once, before any rank starts.
    """
    skipped = plan_resume(cfg)
    if cfg.layout.world_size == 1:
        return execute(cfg, observer, skipped=skipped, report_name=report_name)
    if cfg.model_path is None:  # built-in model: write its directory once, before ranks race for it
        from runtime.models.tiny import materialize

        materialize()

    def on_event(kind: str, payload: tuple) -> None:
        if observer is not None:
            getattr(observer, kind)(*payload)

    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    reports = run_ranks(
        rank_main,
        cfg.layout.world_size,
        (cfg, skipped, report_name),
        timeout_s=cfg.timeout_s,
        backend="nccl" if use_cuda else "gloo",
        log_dir=cfg.out_dir / "logs",
        on_event=on_event,
    )
    return reports[0]
