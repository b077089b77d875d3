"""Ranks another launcher started (torchrun, Kubernetes' PyTorchJob and JobSet, MPI with the
torch.distributed variables): `ditango generate` runs as the rank its environment names.

Every process validates the same command line, joins the launcher's process group (env://,
the setup timeout), and runs its share of the items as a rank of any other launcher does
(slurm/entry.py `run_rank`). Rank 0 alone owns the output folder (its lock), decides what is
already done (resume and skip-done as everywhere else), writes the videos and the report,
and speaks; the other ranks stay quiet. Array tasks (--array) run one after the other.

A failure ends the process promptly and non-zero, and the launcher ends the others (torchrun
does on the first worker to fail; under NCCL a peer would otherwise wait in its collective
until the watchdog). The rank that failed is the one blamed: a rank's own error goes to the
launcher's error file (TORCHELASTIC_ERROR_FILE: torchrun's summary shows it as the root cause)
and to `.ditango/ranks/`, where rank 0 reads it to record the item that was running. A rank
that only saw a peer go waits PEER_GRACE_S before it exits, so that the launcher, which
blames the first process to exit, sees the one that failed first (a killed one says nothing).

Retries are the launcher's (torchrun --max-restarts): each restart is a later launch of the
same run (torchrun's run id and restart count), which resumes. Rank 0 keeps the run's attempts
in `.ditango/launch.json`: a restart first records what the previous launch left running (a
rank blocked in an NCCL collective, or killed, never records its failure), then skips what is
settled, an item failed more than --retries times included. A new torchrun is a new command:
it retries failed items afresh, as the other executors do. Without a restart, an item whose
failure nobody recorded stays "running" and the next command makes it again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from basics.errors import ConfigError
from basics.user_files import read_text
from runtime.batch_open import begin_batch
from runtime.config import RunConfig
from runtime.context import Observer
from runtime.errors import OutputWriteError, is_peer_failure
from runtime.outputs import STATE_DIR, fs_clock, read_record, settled_since
from runtime.report import SCHEMA
from runtime.resume import plan_resume
from runtime.video import write_json
from slurm.rank import LaunchedRank, apply_environment, exit_soon, join, select_device

PEER_GRACE_S = 5.0  # how long a rank that saw a peer fail waits before it exits
ERROR_WAIT_S = 2.0  # how long rank 0 waits for a failed peer's error file


def launcher_layout(launched: LaunchedRank, nodes: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a run under a launcher: as given when given (they must make
    the launcher's world), else the launcher's own (LOCAL_WORLD_SIZE ranks per node, which
    torchrun sets; one per node without it, as Kubernetes starts one pod per rank)."""
    world = launched.world_size
    if (nodes, gpus_per_node) != (1, 1):
        if nodes * gpus_per_node != world:
            raise ConfigError(
                f"--nodes {nodes} x --gpus-per-node {gpus_per_node} is {nodes * gpus_per_node} rank(s), but the "
                f"launcher started {world}; leave them out to take the launcher's, or start {nodes * gpus_per_node}"
            )
        return nodes, gpus_per_node
    per_node = launched.local_size if launched.local_size > 0 and world % launched.local_size == 0 else 1
    return world // per_node, per_node


def errors_dir(out_dir: Path) -> Path:
    return out_dir / STATE_DIR / "ranks"


def run_launched(
    cfg: RunConfig, launched: LaunchedRank, tasks: int, observer: Observer, say: Callable[[str], None]
) -> dict | None:
    """Run `cfg` as rank `launched.rank`; the run report on rank 0, None elsewhere. Raises
    `LaunchedRankFailed` (one line, the rank and its error) once the failure is recorded."""
    if cfg.world_size != launched.world_size or cfg.replicas > 1:  # the CLI made it so (generate.py launcher_args)
        raise ConfigError(
            f"the run has {cfg.world_size} rank(s) in {cfg.replicas} replica(s), the launcher started "
            f"{launched.world_size} for one"
        )
    apply_environment(cfg.out_dir)
    device = select_device(cfg.device, launched.local_rank, launched.local_size)
    previous = signal.signal(signal.SIGTERM, _terminated)  # the launcher ends the others so: record, then go
    series = lock = None
    owned = False
    try:
        _join(cfg, launched, device)
        lock, series, decided, batch = _own_folder(cfg, launched, say)
        owned = True
        cfg = replace(cfg, queue=replace(cfg.queue, batch=batch, launch=launch_key(launched)))
        return _tasks(cfg, launched, tasks, device, observer, decided)
    except BaseException as exc:  # noqa: BLE001 - every failure is this rank's outcome
        # The command or the folder, before any item (one line, exit 2); or the user's Ctrl-C
        # (no item failed: the same command resumes). Anything else is this rank's failure.
        if isinstance(exc, KeyboardInterrupt) or (isinstance(exc, ConfigError) and not owned):
            exit_soon()
            if isinstance(exc, ConfigError) and dist.is_initialized():  # every rank stops here, together:
                dist.destroy_process_group()  # not left to the interpreter's exit, which can abort on it
            raise
        raise _failed(cfg, launched, exc, series) from None
    finally:
        if lock is not None:
            lock.release()
        signal.signal(signal.SIGTERM, previous)


def _join(cfg: RunConfig, launched: LaunchedRank, device: torch.device) -> None:
    try:
        join(
            device,
            rank=launched.rank,
            world_size=launched.world_size,
            timeout_s=cfg.setup_timeout_s,
            init_method="env://",
        )
    except Exception as exc:
        if launched.restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's restarts reuse its rendezvous store, where a restarted process group
            # can meet the previous launch's addresses (pytorch/pytorch#135712, #167288).
            raise RuntimeError(
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} (a torchrun "
                "restart that shares its rendezvous store: start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)"
            ) from exc
        raise


@dataclass
class Series:
    """What rank 0 keeps across the launches of one run of the launcher (torchrun's restarts
    share its run id), in `.ditango/launch.json`: when the first began (`since`, fs_clock),
    each item's failed attempts, and when this launch began (`started`, not kept)."""

    run_id: str
    since: float
    attempts: dict[str, int] = field(default_factory=dict)
    started: float = 0.0

    @staticmethod
    def path(out_dir: Path) -> Path:
        return out_dir / STATE_DIR / "launch.json"

    @classmethod
    def of(cls, cfg: RunConfig, launched: LaunchedRank) -> Series:
        """This launch's series: the one the previous launch kept when this is a restart of it,
        else a new one (a first launch; torchrun says which by its restart count)."""
        now = fs_clock(cfg.out_dir)
        kept = read_record(cls.path(cfg.out_dir)) if launched.restart > 0 else None
        if kept is not None and kept.get("run_id") == launched.run_id and isinstance(kept.get("since"), (int, float)):
            attempts = {k: v for k, v in (kept.get("attempts") or {}).items() if isinstance(v, int)}
            series = cls(launched.run_id, kept["since"], attempts, now)
        else:
            series = cls(launched.run_id, now, {}, now)
        series.keep(cfg)
        return series

    def keep(self, cfg: RunConfig) -> None:
        write_json(
            self.path(cfg.out_dir),
            {"schema": SCHEMA, "run_id": self.run_id, "since": self.since, "attempts": self.attempts},
        )

    def queue_blame(self, cfg: RunConfig, error: str, launched: LaunchedRank, say) -> None:
        """Under the queue: the leases this run's earlier launches (or this one) left, failed."""
        from runtime.pull import open_batch
        from slurm.supervise import Outcome, break_leases

        holder = Outcome(0, error, holder=f"{launch_key(launched)}/")
        for line in break_leases(cfg, open_batch(cfg), holder, {}, True)[0]:
            say(line)

    def blame(self, cfg: RunConfig, error: str, since: float) -> list[str]:
        """Record the items marked running since `since` failed (slurm/supervise.py blame),
        counting this series' attempts; a line per item."""
        from slurm.supervise import blame

        lines, _ = blame(cfg, error, self.attempts, {}, since)
        self.keep(cfg)
        return lines


def _own_folder(cfg: RunConfig, launched: LaunchedRank, say) -> tuple[object, Series | None, dict]:
    """Rank 0 takes the output folder (slurm/ownership.py), records what the previous launch of
    this series left running (under NCCL a rank blocked in a collective cannot record its
    failure; a killed one never does), decides what earlier launches settled (done, given up)
    and begins the batch (a restart goes on with its run's). Every rank learns that, or why the
    folder was refused. A --join takes nothing: it works on the batch its folder's owner began
    (a failure of its ranks is not recorded: their leases run out, and another worker retries)."""
    from slurm.ownership import own_output_folder

    lock = series = batch = None
    refused, decided = None, {}
    if launched.writer and cfg.queue.batch is not None:  # --join: the folder is its batch owner's
        batch = cfg.queue.batch
    elif launched.writer:
        try:
            lock = own_output_folder(cfg.out_dir, False, say)
            series = Series.of(cfg, launched)
            if launched.restart > 0 and cfg.queue.mode != "shared":
                error = _peer_error(cfg, wait_s=0.0) or "a rank ended without saying why (killed, or out of memory)"
                for line in series.blame(cfg, f"previous launch: {error}", series.since):
                    say(line)
            for stale in errors_dir(cfg.out_dir).glob("rank-*.error"):  # the previous launch's
                stale.unlink(missing_ok=True)
            decided = settled_since(cfg, series.since)
            skipped = plan_resume(cfg)  # outputs made otherwise refuse the run here, in one line, as before any launch
            if cfg.queue.mode == "shared":  # a restart goes on with the batch its run began
                batch = begin_batch(cfg, set(skipped), launch_key(launched), cfg.options).queue.batch
                if launched.restart > 0:  # the previous launch's leases: its processes are gone
                    error = _peer_error(cfg, wait_s=0.0) or "a rank ended without saying why (killed, or out of memory)"
                    series.queue_blame(
                        replace(cfg, queue=replace(cfg.queue, batch=batch)), f"previous launch: {error}", launched, say
                    )
        except (ConfigError, OutputWriteError, OSError) as exc:  # every rank must hear of it, or they wait
            refused = str(exc).removesuffix(", or pass --wait-for-lock")  # refused under a launcher
    box = [refused, decided, batch]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        if lock is not None:  # taken before the refusal: given back, not left for a takeover
            lock.release()
        raise ConfigError(box[0])
    return lock, series, box[1], box[2]


def launch_key(launched: LaunchedRank) -> str:
    """The key of a launcher's run (its restarts share it; a run without an id is its own)."""
    return f"torchrun-{launched.run_id or os.getpid()}"


def _tasks(cfg: RunConfig, launched: LaunchedRank, tasks: int, device: torch.device, observer, decided: dict):
    from slurm.aggregate import aggregate
    from slurm.entry import run_rank
    from slurm.sharding import share
    from slurm.supervise import task_report

    node_of = [None] * launched.world_size
    dist.all_gather_object(node_of, launched.node)  # the real topology (byte counters, DiTango's groups)
    nodes = {n: i for i, n in enumerate(dict.fromkeys(node_of))}
    placed = tuple(nodes[n] for n in node_of)
    report = None
    for task in range(tasks):
        items = tuple(share(cfg, task, tasks))
        if items:
            queue = replace(cfg.queue, launch=f"{cfg.queue.launch}/t{task}")
            report = run_rank(
                replace(cfg, items=items, queue=queue),
                launched.rank,
                placed,
                0,
                task_report(task, tasks, cfg.queue.report),
                observer,
                launched.rank,
                device,
                decided=decided,
            )
    dist.destroy_process_group()
    if not launched.writer:
        return None
    if tasks == 1 and report is not None and {i.id for i in cfg.items} <= {r.get("id") for r in report["items"]}:
        return report
    return aggregate(cfg.out_dir)  # several tasks, or other workers of the queue made items


class LaunchedRankFailed(RuntimeError):
    """This rank failed (`peer` False) or saw a peer fail; the message is one line."""

    def __init__(self, message: str, peer: bool) -> None:
        super().__init__(message)
        self.peer = peer


class Terminated(BaseException):
    """The launcher's SIGTERM: it ends the other ranks so when one fails, or when it is stopped."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not interrupt the record
    raise Terminated("terminated by the launcher (another rank failed, or the job was stopped)")


def _failed(cfg: RunConfig, launched: LaunchedRank, exc: BaseException, series: Series | None) -> LaunchedRankFailed:
    """Say and record this rank's failure: its own error to the launcher and the folder, the
    running item's failure (rank 0) with the error of the rank that failed first where it
    is known. Arms the exit deadline; a peer's reaction waits PEER_GRACE_S first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the record first (seconds; torchrun waits 30 s to SIGKILL)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    terminated = isinstance(exc, Terminated)
    peer = terminated or is_peer_failure(message)
    line = f"rank {launched.rank}: {text if terminated else message}"
    if not peer:
        _error_file(cfg, launched, line)
    if series is not None:  # rank 0, once it owns the folder
        seen = f"rank {launched.rank} lost a peer ({message}); the launcher's summary names the rank that failed"
        _record(cfg, series, line if not peer else _peer_error(cfg) or (line if terminated else seen), launched)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from now on the launcher's SIGTERM just ends it
    exit_soon()
    # torchrun dates each failure to the second and blames the earliest: a rank that only
    # reacts exits later, so that it cannot take the blame from the one that failed first.
    if peer:
        time.sleep(1.5 if terminated else PEER_GRACE_S)
    return LaunchedRankFailed(line, peer)


def _error_file(cfg: RunConfig, launched: LaunchedRank, line: str) -> None:
    """This rank's own error where the launcher and rank 0 read it."""
    try:
        folder = errors_dir(cfg.out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{launched.rank}.error").write_text(line + "\n", encoding="utf-8")
    except OSError:
        pass
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # torchrun's summary names the root cause by this file's message and time
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            Path(path).write_text(json.dumps(record), encoding="utf-8")
        except OSError:
            pass


def _peer_error(cfg: RunConfig, wait_s: float = ERROR_WAIT_S) -> str | None:
    """The error a failed peer wrote (waiting up to `wait_s` for it); None: none did (it was
    killed, or is on another node whose file has not arrived)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = sorted(errors_dir(cfg.out_dir).glob("rank-*.error"), key=lambda p: p.stat().st_mtime)
        for path in found:
            try:  # bounded, a regular file only (a FIFO there would block this rank for ever)
                return read_text(path, "rank error", 2**16).strip()
            except (OSError, ConfigError):
                continue
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def _record(cfg: RunConfig, series: Series, error: str, launched: LaunchedRank) -> None:
    """Rank 0: the items marked running since this launch began, recorded failed (an item is
    given up after `cfg.retries` retries, counted over the series' launches)."""
    try:
        if cfg.queue.shared:
            series.queue_blame(cfg, error, launched, lambda line: None)
        else:
            series.blame(cfg, error, series.started)
    except Exception:  # noqa: BLE001 - the run is failing already: its own error is what to say
        print(f"note: the running item's failure could not be recorded in {cfg.out_dir}", file=sys.stderr)
