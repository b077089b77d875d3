"""Run N ranks as local processes and supervise them.

Each rank is a spawned process that joins a process group (file rendezvous in a private
temp dir; gloo on CPU, NCCL on CUDA), with the group timeout applied to every
collective. Rank 0 may send progress events to the supervisor; other ranks' stdout and
stderr go to per-rank log files. The first rank to fail ends the run: the others are
terminated and `RankFailed` carries that rank's error, so nothing waits on a dead peer.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLL_S = 0.1
GRACE_S = 5.0
EXIT_WAIT_S = 30.0  # after every result is in, how long ranks may take to exit


class RankFailed(RuntimeError):
    def __init__(self, rank: int, message: str, log: Path | None = None) -> None:
        self.rank, self.message, self.log = rank, message, log
        where = f" (log: {log})" if log else ""
        super().__init__(f"rank {rank} failed: {message}{where}")


class EventSink:
    """What a rank's target gets to report progress: global rank 0 reports everything (progress
    follows the first replica); the first rank of another replica only its messages."""

    def __init__(self, rank: int, q, replica: int = 0, leader: bool | None = None) -> None:
        self.rank, self._q, self.replica = rank, q, replica
        self.leader = rank == 0 if leader is None else leader

    def emit(self, kind: str, *payload) -> None:
        if self.rank == 0 or (self.leader and kind == "message"):
            self._q.put(("event", self.rank, kind, payload))


def _redirect_output(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank if the supervisor dies (no orphans holding GPUs or ports)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _bootstrap(rank, world, replicas, rdzv, backend, timeout_s, threads, log_dir, q, target, args):
    _die_with_parent()
    try:
        if log_dir is not None:
            _redirect_output(Path(log_dir) / f"rank-{rank}.log")
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        # Each replica is its own process group (world), with its own rendezvous file.
        size = world // replicas
        replica, local = divmod(rank, size)
        dist.init_process_group(
            backend, init_method=f"file://{rdzv}/store-{replica}", rank=local, world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        result = target(local, size, EventSink(rank, q, replica, leader=local == 0), *args)
        q.put(("result", rank, result))
    except BaseException as exc:  # report everything, including KeyboardInterrupt, then exit non-zero
        traceback.print_exc()
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    target: Callable,
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 600.0,
    backend: str = "gloo",
    log_dir: Path | None = None,
    on_event: Callable[[str, tuple], None] | None = None,
    replicas: int = 1,
) -> list:
    """Run `target(rank, world_size, events, *args)` on `world_size` processes; return results by rank.

    With `replicas` R, the processes form R independent process groups of world_size / R
    ranks (contiguous blocks); `target` sees its rank and size inside its group, and
    `events.replica`. `RankFailed.rank` is the global rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    results: dict[int, object] = {}
    if replicas < 1 or world_size % replicas:
        raise ValueError(f"{replicas} replicas do not divide {world_size} ranks")
    with tempfile.TemporaryDirectory(prefix="ditango-rdzv-") as rdzv:
        procs = [
            ctx.Process(
                target=_bootstrap,
                args=(rank, world_size, replicas, rdzv, backend, timeout_s, threads, log_dir, q, target, args),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        # SIGTERM to the supervisor (e.g. scancel, kill) must still stop the ranks: turn it into
        # an exception so the `finally` below runs.
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            while len(results) < world_size:
                try:
                    kind, rank, *rest = q.get(timeout=POLL_S)
                except queue_mod.Empty:
                    for rank, p in enumerate(procs):
                        if p.exitcode not in (None, 0) and rank not in results:
                            _drain_error(q, rank, p.exitcode, log_dir)
                    continue
                if kind == "event":
                    if on_event is not None:
                        on_event(rest[0], rest[1])
                elif kind == "result":
                    results[rank] = rest[0]
                else:
                    raise RankFailed(rank, rest[0], _log(log_dir, rank))
            deadline = time.monotonic() + EXIT_WAIT_S
            for p in procs:  # ranks only tear down now; one stuck there is stopped by `_stop`
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            _stop(procs)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)
    return [results[r] for r in range(world_size)]


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _log(log_dir: Path | None, rank: int) -> Path | None:
    return None if log_dir is None else Path(log_dir) / f"rank-{rank}.log"


def _drain_error(q, rank: int, exitcode: int, log_dir: Path | None) -> None:
    """A rank died: prefer its own error message (it may still be in the queue)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            kind, who, *rest = q.get(timeout=POLL_S)
        except queue_mod.Empty:
            continue
        if kind == "error":
            raise RankFailed(who, rest[0], _log(log_dir, who))
    raise RankFailed(rank, f"process exited with code {exitcode}", _log(log_dir, rank))


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
