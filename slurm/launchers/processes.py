"""Run N ranks as local processes and supervise them.

Each rank is a spawned process, in a process session of its own as torchrun's workers are,
that joins a process group (file rendezvous in a private temp dir; gloo on CPU, NCCL on CUDA
with rank g on GPU g; see slurm/rank.py), with the group timeout applied to every
collective. Rank 0 may send progress events to the supervisor; other ranks' stdout and
stderr go to per-rank log files.

The first rank to fail ends the run, and it is the one blamed, not a peer that only saw it
go. A failure is a rank's own error (sent before the rank exits at once) or a process that
exits without one (killed by a signal, out of memory, a crash in native code). After the
first, the supervisor collects the others for up to WINDOW_S, terminates every rank, and
raises `RankFailed` for the first real cause (`blame_order`), the peers' reactions listed
after it. A rank that is stopped (SIGSTOP, a frozen machine) says nothing and does not exit:
its peers time out. Each rank's heartbeat thread, which stops only with the whole process,
names it then; and a heartbeat older than `stale_s` (the run's step timeout) ends the run by
itself: the peers may be waiting on the stopped rank under the far longer setup timeout (the
writer decoding and writing a video), which would hold the run for half an hour.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from runtime.errors import is_peer_failure
from slurm.heartbeat import stopped_message
from slurm.rank import apply_environment, join, select_device
from slurm.rank_process import die_with_parent, own_session, rank_threads, redirect_output

POLL_S = 0.1
GRACE_S = 5.0
EXIT_WAIT_S = 30.0  # after every result is in, how long ranks may take to exit
HEARTBEAT_S = 0.5  # how often each rank writes its heartbeat
# A heartbeat older than this: the rank is stopped, not busy (its heartbeat thread runs
# whatever the main thread does). Peers time out no earlier than --timeout after a rank
# stops, so a stopped rank is found whenever --timeout is longer than this.
STALE_S = 3.0
WINDOW_S = 1.0  # after the first sign of failure, how long to wait for the others
BRIEF_CHARS = 100  # of each later error in the message


class RankFailed(RuntimeError):
    """Global rank `rank` failed first, with `message` (one line); `then`: (rank, brief message)
    of the failures seen after it, peers' reactions among them."""

    def __init__(self, rank: int, message: str, log: Path | None = None, then: Iterable[tuple[int, str]] = ()) -> None:
        self.rank, self.message, self.log, self.then = rank, message, log, tuple(then)
        where = f" (log: {log})" if log else ""
        after = "; then " + ", ".join(f"rank {r}: {m}" for r, m in self.then) if self.then else ""
        super().__init__(f"rank {rank} failed: {message}{where}{after}")


@dataclass(frozen=True)
class Failure:
    """One rank's sign of failure, as the supervisor saw it."""

    rank: int  # global
    how: Literal["error", "peer", "exit", "stopped"]  # own exception, reaction to a peer, death, no heartbeat
    message: str  # one line
    at: float  # time.monotonic() when it happened, as near as known

    @property
    def cause(self) -> bool:
        """Whether this can be the root cause: anything but a reaction to another rank's failure."""
        return self.how != "peer"


def blame_order(failures: Iterable[Failure]) -> list[Failure]:
    """The failures, the one to blame first: every real cause (a rank's own error, a process
    that died, a stopped heartbeat) before any peer's reaction ('connection reset', 'timed
    out'), each kind in order of time, ties by rank."""
    return sorted(failures, key=lambda f: (not f.cause, f.at, f.rank))


def rank_failed(failures: Iterable[Failure], log_dir: Path | None) -> RankFailed:
    """The error of a launch that failed so: the first of `blame_order`, the others briefly."""
    first, *rest = blame_order(failures)
    return RankFailed(first.rank, first.message, _log(log_dir, first.rank), [(f.rank, _brief(f.message)) for f in rest])


class EventSink:
    """What a rank's target gets to report progress: global rank 0 reports everything (progress
    follows the first replica); the first rank of another replica only its messages."""

    def __init__(self, rank: int, q, replica: int = 0, leader: bool | None = None) -> None:
        self.rank, self._q, self.replica = rank, q, replica
        self.leader = rank == 0 if leader is None else leader

    def emit(self, kind: str, *payload) -> None:
        if self.rank == 0 or (self.leader and kind == "message"):
            self._q.put(("event", self.rank, kind, payload))


def _heartbeat(beats, rank: int) -> None:
    """Write this rank's time into `beats` every HEARTBEAT_S, from a thread of its own: it goes
    on while the main thread computes or waits in a collective, and stops only when the whole
    process does."""
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        time.sleep(HEARTBEAT_S)


def _bootstrap(rank, world, replicas, rdzv, device, timeout_s, threads, log_dir, q, beats, target, args):
    own_session()
    die_with_parent()
    threading.Thread(target=_heartbeat, args=(beats, rank), name="heartbeat", daemon=True).start()
    # Progress bars (model loading) take a thread lock: tqdm's default one is a multiprocessing
    # semaphore, which a rank that exits at once on a failure leaves behind, and the resource
    # tracker of the supervisor then warns of it below the one-line error.
    tqdm.set_lock(threading.RLock())
    try:
        if log_dir is not None:
            redirect_output(Path(log_dir) / f"rank-{rank}.log")
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
        # By value (plain pickle): the queue's own pickler would share a tensor's memory by a file
        # descriptor, which the supervisor can no longer fetch once this process has exited.
        q.put(("result", rank, pickle.dumps(result)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt, then exit non-zero
        q.put(("error", rank, f"{type(exc).__name__}: {exc}", time.monotonic()))
        # The log next (it may be on a full disk: the error above is sent first). Exit now, without
        # destroy_process_group (it can block with a dead peer): the supervisor stops the other
        # ranks. The queue is flushed first so the error arrives.
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        q.close()
        q.join_thread()
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
    stale_s: float | None = None,
    on_replica_failed: Callable[[int, RankFailed], None] | None = None,
) -> list:
    """Run `target(rank, world_size, events, *args)` on `world_size` processes; return results by rank.

    With `replicas` R, the processes form R independent process groups of world_size / R
    ranks (contiguous blocks); `target` sees its rank and size inside its group, and
    `events.replica`. `RankFailed.rank` is the global rank. `device`: "cpu", "cuda" or "auto"
    (global rank g takes GPU g); `timeout_s`: the process group's (setup) timeout; `stale_s`:
    a rank whose heartbeat is older than this is stopped, which fails the run (None: only
    named once another sign of failure came). With `on_replica_failed` (replicas that share a
    queue), a failure ends its own replica only: its ranks are stopped, the callback hears of it
    (replica, RankFailed), the other replicas go on, and their results come back (None for the
    failed replica's ranks); only when every replica failed is RankFailed raised."""
    ctx = mp.get_context("spawn")
    # One message queue per replica: a replica stopped while one of its ranks held its queue's
    # lock (a put in flight) would otherwise leave every other rank blocked on that lock.
    queues = [ctx.Queue() for _ in range(replicas)]
    threads = rank_threads(world_size)
    if replicas < 1 or world_size % replicas:
        raise ValueError(f"{replicas} replicas do not divide {world_size} ranks")
    # Each rank's last heartbeat (time.monotonic()), in shared memory the ranks write; 0 until
    # a rank's first beat (a rank still starting is not taken for a stopped one).
    beats = ctx.Array("d", world_size, lock=False)
    with tempfile.TemporaryDirectory(prefix="ditango-rdzv-") as rdzv:
        procs = [
            ctx.Process(
                target=_bootstrap,
                args=(
                    rank,
                    world_size,
                    replicas,
                    rdzv,
                    device,
                    timeout_s,
                    threads,
                    log_dir,
                    queues[rank // (world_size // replicas)],
                    beats,
                    target,
                    args,
                ),
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
            watch = _Watch(procs, queues, beats, on_event)
            if on_replica_failed is not None:
                return _isolated(watch, procs, replicas, stale_s, log_dir, on_replica_failed)
            while len(watch.results) < world_size and not watch.failures:
                watch.poll()
                if stale_s is not None:
                    watch.failures.update((f.rank, f) for f in watch.stopped(max(stale_s, STALE_S)))
            if watch.failures:
                raise rank_failed(watch.settle(), log_dir)
            deadline = time.monotonic() + EXIT_WAIT_S
            for p in procs:  # ranks only tear down now; one stuck there is stopped by `_stop`
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            _stop(procs)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)
    return [watch.results[r] for r in range(world_size)]


class _Watch:
    """What the supervisor knows of the ranks: their results, and the first sign of failure of
    each rank that failed."""

    def __init__(self, procs, queues, beats, on_event: Callable[[str, tuple], None] | None) -> None:
        self.procs, self.queues, self.beats, self.on_event = procs, list(queues), beats, on_event
        self.results: dict[int, object] = {}
        self.failures: dict[int, Failure] = {}

    def poll(self) -> None:
        """One round: which ranks have exited, then what the queue holds (waiting up to POLL_S)."""
        # Exit codes before the queue: a rank's error is in the queue before the rank exits,
        # so an exit seen here that the queue does not explain was a death without a word.
        now = time.monotonic()
        exited = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode is not None}
        for kind, rank, *rest in _receive(self.queues, POLL_S):
            if kind == "event":
                if self.on_event is not None:
                    self.on_event(rest[0], rest[1])
            elif kind == "result":
                self.results[rank] = pickle.loads(rest[0])
            elif rank not in self.failures:
                message, at = _first_line(rest[0]), rest[1]
                self.failures[rank] = Failure(rank, "peer" if is_peer_failure(message) else "error", message, at)
        for rank, code in exited.items():
            if rank not in self.results and rank not in self.failures:
                self.failures[rank] = Failure(rank, "exit", _exit_message(code), now)

    def settle(self, ranks: range | None = None) -> list[Failure]:
        """After the first sign of failure: the failures seen within WINDOW_S (or until every
        rank is accounted for), and the ranks whose heartbeat stopped, dated by their last beat.
        Those never say a word: their peers only time out, or, under NCCL, their watchdog ends
        them (SIGABRT), which without the heartbeat would read as a death of their own.
        `ranks`: those of one replica (default all)."""
        ranks = range(len(self.procs)) if ranks is None else ranks
        deadline = time.monotonic() + WINDOW_S
        while time.monotonic() < deadline and any(r not in self.failures and r not in self.results for r in ranks):
            self.poll()
        return [f for f in (*self.failures.values(), *self.stopped()) if f.rank in ranks]

    def stopped(self, stale_s: float = STALE_S) -> list[Failure]:
        """Ranks still running whose heartbeat is older than `stale_s` (started ones only)."""
        now, out = time.monotonic(), []
        for rank, p in enumerate(self.procs):
            beat = self.beats[rank]
            done = rank in self.failures or rank in self.results or p.exitcode is not None
            if done or beat == 0.0 or now - beat <= stale_s:
                continue
            message = stopped_message(now - beat)
            out.append(Failure(rank, "stopped", message, beat))
        return out


def _isolated(watch: _Watch, procs, replicas: int, stale_s, log_dir, on_failed) -> list:
    """`run_ranks`' loop when a replica's failure ends that replica only (see there)."""
    size = len(procs) // replicas
    failed: dict[int, RankFailed] = {}

    def running(r: int) -> bool:
        return r not in failed and any(g not in watch.results for g in range(r * size, (r + 1) * size))

    while any(running(r) for r in range(replicas)):
        watch.poll()
        if stale_s is not None:
            watch.failures.update((f.rank, f) for f in watch.stopped(max(stale_s, STALE_S)))
        for r in {f.rank // size for f in watch.failures.values()} - set(failed):
            ranks = range(r * size, (r + 1) * size)
            failed[r] = rank_failed(watch.settle(ranks), log_dir)
            _stop([procs[g] for g in ranks])
            watch.queues[r] = None  # its ranks may have died inside a put: never read again
            on_failed(r, failed[r])
    if len(failed) == replicas:
        raise failed[min(failed)]
    deadline = time.monotonic() + EXIT_WAIT_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    return [watch.results.get(g) for g in range(len(procs))]


def _receive(queues, timeout: float) -> list[tuple]:
    """What the queues hold (None: a stopped replica's, no longer read): waits up to `timeout`
    for a first message, then takes the rest."""
    live = [q for q in queues if q is not None]
    out: list[tuple] = []
    deadline = time.monotonic() + timeout
    while True:
        for q in live:
            try:
                while True:
                    out.append(q.get_nowait())
            except queue_mod.Empty:
                pass
        if out or time.monotonic() >= deadline:
            return out
        time.sleep(min(0.01, timeout))


def _exit_message(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"process killed by signal {-code} ({name}) without an error"
    if code == 0:
        return "process exited with code 0 without a result"
    return f"process exited with code {code} without an error"


def _first_line(message: str) -> str:
    """An error's first line: torch appends C++ stack traces to some (the rank's log has all)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    return lines[0] if lines else message.strip()


# "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] ": where in C++ an error was raised.
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+:\d+\] ?")


def _brief(message: str) -> str:
    """A later error as it is listed after the first: its first sentence, without C++ source
    locations, cut short (gloo's go on with advice: "This is typically caused by ...")."""
    text = _SOURCE_LOCATION.sub("", message).split(". ")[0]
    return text if len(text) <= BRIEF_CHARS else text[: BRIEF_CHARS - 3] + "..."


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _log(log_dir: Path | None, rank: int) -> Path | None:
    return None if log_dir is None else Path(log_dir) / f"rank-{rank}.log"


def _stop(procs) -> None:
    """Terminate the ranks still running; kill those left after GRACE_S. A stopped process
    (SIGSTOP) acts on SIGTERM only once continued: SIGCONT makes it, and SIGKILL, the fallback,
    ends it either way."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
