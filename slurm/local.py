"""Run N ranks as local processes and supervise them.

Each rank is a spawned process that joins a process group (file rendezvous in a private
temp dir; gloo on CPU, NCCL on CUDA with rank g on GPU g; see slurm/rank.py), with the
group timeout applied to every collective. Rank 0 may send progress events to the
supervisor; other ranks' stdout and stderr go to per-rank log files. The first rank to fail
ends the run: it reports its error and exits at once, the others are terminated, and
`RankFailed` carries that rank's error, so nothing waits on a dead peer.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurm.rank import apply_environment, is_peer_failure, join, select_device

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


def _bootstrap(rank, world, replicas, rdzv, device, timeout_s, threads, log_dir, q, target, args):
    _die_with_parent()
    try:
        if log_dir is not None:
            _redirect_output(Path(log_dir) / f"rank-{rank}.log")
            apply_environment(Path(log_dir).parent)
        torch.set_num_threads(threads)
        # The GPU of the GLOBAL rank (all ranks are on this machine): replica r's ranks get
        # their own GPUs, not the first ones again.
        rank_device = select_device(device, rank)
        # Each replica is its own process group (world), with its own rendezvous file.
        size = world // replicas
        replica, local = divmod(rank, size)
        join(
            rank_device, rank=local, world_size=size, timeout_s=timeout_s, init_method=f"file://{rdzv}/store-{replica}"
        )
        result = target(local, size, EventSink(rank, q, replica, leader=local == 0), *args)
        q.put(("result", rank, result))
    except BaseException as exc:  # report everything, including KeyboardInterrupt, then exit non-zero
        traceback.print_exc()
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        # Exit now, without destroy_process_group (it can block with a dead peer): the
        # supervisor stops the other ranks. The queue is flushed first so the error arrives.
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    target: Callable,
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 600.0,
    device: str = "cpu",
    log_dir: Path | None = None,
    on_event: Callable[[str, tuple], None] | None = None,
    replicas: int = 1,
) -> list:
    """Run `target(rank, world_size, events, *args)` on `world_size` processes; return results by rank.

    With `replicas` R, the processes form R independent process groups of world_size / R
    ranks (contiguous blocks); `target` sees its rank and size inside its group, and
    `events.replica`. `RankFailed.rank` is the global rank. `device`: "cpu", "cuda" or "auto"
    (global rank g takes GPU g); `timeout_s`: the process group's (setup) timeout."""
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
                args=(rank, world_size, replicas, rdzv, device, timeout_s, threads, log_dir, q, target, args),
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
                    raise _root_cause(q, procs, rank, rest[0], log_dir)
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


def _root_cause(q, procs, rank: int, message: str, log_dir: Path | None) -> RankFailed:
    """The failure to report when `rank` sent `message`. A peer's reaction ('connection closed',
    'timed out') usually means another rank died without a word (killed, out of memory, a
    crash in native code): within a second, such a rank is the one to blame."""
    if not is_peer_failure(message):
        return RankFailed(rank, message, _log(log_dir, rank))
    spoke = {rank}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            kind, who, *rest = q.get(timeout=POLL_S)
            if kind == "error":
                spoke.add(who)
                if not is_peer_failure(rest[0]):  # a rank with its own error: the cause
                    return RankFailed(who, rest[0], _log(log_dir, who))
        except queue_mod.Empty:
            pass
        silent = [(r, p.exitcode) for r, p in enumerate(procs) if r not in spoke and p.exitcode not in (None, 0)]
        if silent:
            r, code = silent[0]
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return RankFailed(r, f"process {how} without an error (its peer {rank}: {message})", _log(log_dir, r))
    return RankFailed(rank, message, _log(log_dir, rank))


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
