"""Fault injection: a debugging aid and the test hook of every failure path.

DITANGO_FAULT_INJECT=RANK:STEP[:ITEM_ID]   that rank fails after that denoising step
                                           (of that item only, when given); STEP may
                                           also be a phase after the steps: decode, or
                                           write (the writer, before the MP4)
DITANGO_FAULT_ONCE=FILE                    fire once: FILE is created when it fires, and
                                           an existing FILE disarms it (a transient failure)
DITANGO_FAULT_KIND=raise|hang|exit|kill|stop
                                           how: raise (default); hang (the rank's main thread
                                           stops answering, as a wedged GPU would: its peers
                                           must time out); exit (it dies at once, exit code 3);
                                           kill (it sends itself SIGKILL: what `kill -9` or
                                           the kernel's OOM killer does); stop (it sends itself
                                           SIGSTOP: every thread freezes, as under `kill -STOP`
                                           or a frozen node; its peers must time out)

In a one-rank run the rank is the CLI process itself: kill and stop end or freeze the CLI.
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "DITANGO_FAULT_INJECT"
FAULT_ONCE_ENV = "DITANGO_FAULT_ONCE"
FAULT_KIND_ENV = "DITANGO_FAULT_KIND"
FAULT_KINDS = ("raise", "hang", "exit", "kill", "stop")


def with_faults(observer, rank: int):
    """`observer` with the fault hook in front when DITANGO_FAULT_INJECT asks for one, else as it is."""
    return FaultInjecting(observer, rank) if os.environ.get(FAULT_ENV) else observer


class FaultInjecting:
    """An observer of one rank with the fault hook in front; every call reaches `inner`."""

    def __init__(self, inner, rank: int) -> None:
        self.inner, self.rank, self.item = inner, rank, None
        raw = os.environ.get(FAULT_ENV)
        self.spec = raw.split(":", 2) if raw else None
        self.once = os.environ.get(FAULT_ONCE_ENV)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def item_started(self, item) -> None:
        self.item = item.id
        self.inner.item_started(item)

    def step_done(self, step: int, steps: int) -> None:
        self._maybe_fail(step)
        self.inner.step_done(step, steps)

    def phase(self, name: str) -> None:
        self._maybe_fail(name)
        self.inner.phase(name)

    def _maybe_fail(self, step: int | str) -> None:
        if self.spec is None or (self.spec[0], self.spec[1]) != (str(self.rank), str(step)):
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
        if kind == "kill":  # does not return
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stop":  # frozen until SIGCONT (then it goes on) or SIGKILL
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        raise RuntimeError(f"injected fault on rank {self.rank} after step {step} ({FAULT_ENV})")
