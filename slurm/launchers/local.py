"""The local executor: a RunConfig's ranks as processes on this machine (or this process).

One rank runs in this process. Several ranks run as local processes (`--executor local`);
`--nodes M` then means M virtual nodes: rank r sits on node r // gpus_per_node, which is
what the byte counters and the topology-aware strategies see. With `--replicas R` the ranks
form R independent process groups, each taking the next item from the output folder's queue
(round-robin with --queue static); a replica that fails ends alone. `--array N` runs the
shards one after another. Retries are the supervisor's (slurm/supervise.py).
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from basics.errors import ConfigError
from runtime.config import RunConfig
from runtime.context import Observer, RankContext, SilentObserver
from runtime.pull import open_batch, own_skips
from runtime.resume import plan_resume
from runtime.run import execute, settled_report
from slurm.aggregate import aggregate
from slurm.entry import run_rank
from slurm.faults import with_faults
from slurm.launchers.processes import EventSink, RankFailed, run_ranks
from slurm.rank import current_device, select_device
from slurm.sharding import share
from slurm.supervise import Outcome, break_leases, task_report


class _Forwarding:
    """A worker rank's observer: forwards calls to the supervising process (EventSink keeps
    global rank 0's, and other replica leaders' messages)."""

    def __init__(self, events: EventSink) -> None:
        self.events = events

    def __getattr__(self, kind):
        return lambda *payload: self.events.emit(kind, *payload)


def node_map(cfg: RunConfig, replica: int) -> tuple[int, ...]:
    """Local runs: global rank g sits on virtual node g // (ranks per node of the allocation)."""
    size = cfg.layout.world_size
    return tuple((replica * size + r) // cfg.gpus_per_node for r in range(size))


def rank_main(
    rank: int, world: int, events: EventSink, cfg: RunConfig, skipped: dict, report_name: str, decided: dict
) -> dict | None:
    """Entry point of one local rank (after its replica's process group is up)."""
    return run_rank(
        cfg,
        rank,
        node_map(cfg, events.replica),
        events.replica,
        report_name,
        _Forwarding(events),
        events.rank,
        current_device(),
        skipped,
        decided,
    )


class LocalExecutor:
    """Array tasks one after the other, each a launch of its shard's ranks."""

    def __init__(self, cfg: RunConfig, tasks: int = 1, observer: Observer | None = None) -> None:
        self.cfg, self.tasks = cfg, tasks
        self.observer = observer or SilentObserver()
        self._report: dict | None = None

    def launch(self, tasks: list[int], decided: dict[str, dict]) -> list[Outcome]:
        outcomes = []
        key = uuid.uuid4().hex[:8]  # this launch's: its workers' leases carry it
        for task in tasks:
            launch = f"{key}/t{task}"
            queue = replace(self.cfg.queue, launch=launch)
            cfg = replace(self.cfg, items=tuple(share(self.cfg, task, self.tasks)), queue=queue)
            name = task_report(task, self.tasks, cfg.queue.report)
            done = plan_resume(cfg)  # decided here, before any rank starts
            skipped = own_skips(cfg, done)
            if all(i.id in done or i.id in decided for i in cfg.items):  # nothing to do: no rank starts
                for item_id in sorted(set(skipped) - set(decided)):
                    self.observer.message(
                        f"skipping {item_id}: {item_id}.mp4 and {item_id}.json exist (use --overwrite)"
                    )
                self._report = settled_report(cfg, {**skipped, **decided}, name)
                outcomes.append(Outcome(task))
                continue
            if cfg.world_size == 1:  # this process; the supervisor retries a failure as for many ranks
                ctx = RankContext.single(cfg, select_device(cfg.device, 0))
                observer = with_faults(self.observer, 0)
                one = replace(cfg, queue=replace(cfg.queue, launch=f"{launch}/r0"))  # as replica 0's ranks are
                try:
                    self._report = execute(one, observer, ctx, skipped, report_name=name, decided=decided)
                except ConfigError:
                    raise  # the user's mistake (a model that does not load): one line, exit 2
                except Exception as exc:  # noqa: BLE001 - any other failure of the rank is the launch's outcome
                    outcomes.append(Outcome(task, f"{type(exc).__name__}: {exc}", 0, holder=f"{launch}/"))
                    continue
                outcomes.append(Outcome(task))
                continue
            lost: list[Outcome] = []
            try:
                reports = run_ranks(
                    rank_main,
                    cfg.world_size,
                    (cfg, skipped, name, decided),
                    timeout_s=cfg.setup_timeout_s,
                    device=cfg.device,
                    log_dir=cfg.out_dir / "logs",
                    on_event=self._event,
                    replicas=cfg.replicas,
                    stale_s=cfg.timeout_s,
                    on_replica_failed=self._lost(cfg, task, lost) if cfg.queue.shared and cfg.replicas > 1 else None,
                )
            except RankFailed as exc:
                outcomes.append(Outcome(task, str(exc), exc.rank, holder=f"{launch}/"))
                continue
            self._report = reports[0]
            outcomes += lost or [Outcome(task)]
        return outcomes

    def _lost(self, cfg: RunConfig, task: int, lost: list[Outcome]):
        """What to do when one replica of a task fails while the others go on: its leases are
        recorded failed at once (its processes are gone), so that another worker takes them."""

        def on_failed(replica: int, exc: RankFailed) -> None:
            outcome = Outcome(task, str(exc), exc.rank, f"replica {replica}", holder=f"{cfg.queue.launch}/r{replica}")
            lost.append(outcome)
            lines, _ = break_leases(cfg, open_batch(cfg), outcome, {}, True)
            for line in [f"replica {replica} failed: {exc}; the other replicas go on", *lines]:
                self.observer.message(line)

        return on_failed

    def _event(self, kind: str, payload: tuple) -> None:
        getattr(self.observer, kind)(*payload)

    def report(self) -> dict:
        """The run's report: rank 0's for one task of one replica that made every item itself,
        else the aggregate (other workers joined the queue, or several tasks or replicas ran)."""
        mine = self._report
        if self.tasks == 1 and self.cfg.replicas == 1 and not self.cfg.queue.report and mine is not None:
            if {i.id for i in self.cfg.items} <= {r.get("id") for r in mine["items"]}:
                return mine
        return aggregate(self.cfg.out_dir)
