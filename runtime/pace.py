"""How fast a run goes and when it will end: the ETA arithmetic every progress view shares
(the plain log lines, the rich bar, the heartbeat file `ditango status` reads).

`Pace` is pure: it reads time only from its injected `clock`, so tests drive it with a fake.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EVERY_FRACTION = 0.1  # a log line at least every 10% of an item's steps...
EVERY_S = 30.0  # ...and at least every 30 s of wall time while steps come


def duration(seconds: float) -> str:
    """'0.4 s', '23 s', '2m41s', '1h02m': a duration as a person reads it in a log line."""
    if seconds < 9.95:
        return f"{max(0.0, seconds):.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@dataclass
class Pace:
    """A run's progress: item k of `items` (those this run generates), step i of N, and the ETAs.

    Seconds per step: the mean of this item's steps so far. The first step also holds the text
    encode and the warm-up, so from the second step on it is left out: (t_i - t_1) / (i - 1).
    ETA of the item: its remaining steps at that pace, plus the time the items done so far took
    besides their steps (decode, write, text encode). ETA of the batch: that, plus every item
    still to start at the same number of steps, pace and overhead."""

    items: int = 0
    clock: Callable[[], float] = time.monotonic
    every_fraction: float = EVERY_FRACTION
    every_s: float = EVERY_S
    index: int = 0  # 1-based index of the current item; 0 before the first
    item: str = ""
    steps: int = 0
    step: int = 0
    phase: str = ""
    started: float = 0.0  # clock() at the current item's start
    _step_times: list[float] = field(default_factory=list, init=False, repr=False)  # clock() after each step
    _overheads: list[float] = field(default_factory=list, init=False, repr=False)  # per item done: besides steps
    _line_step: int = field(default=0, init=False, repr=False)  # the step and time of the last line due
    _line_at: float = field(default=0.0, init=False, repr=False)

    def run_started(self, items: int) -> None:
        self.items, self.index = items, 0
        self._overheads.clear()

    def item_started(self, item: str, steps: int) -> None:
        self.index += 1
        self.item, self.steps, self.step, self.phase = item, steps, 0, "denoise"
        self.started = self._line_at = self.clock()
        self._line_step = 0
        self._step_times.clear()

    def step_done(self, step: int, steps: int) -> bool:
        """Record step `step` of `steps`; whether a line is due (then counted as said): the last
        step, `every_fraction` of the steps since the last line, or `every_s` seconds since it."""
        now = self.clock()
        if step <= self.step:  # the item's steps run again (recalibrated with --target-psnr)
            self._step_times.clear()
            self._line_step = 0
        self.step, self.steps, self.phase = step, steps, "denoise"
        self._step_times.append(now)
        due = (
            step >= steps
            or step - self._line_step >= steps * self.every_fraction
            or now - self._line_at >= self.every_s
        )
        if due:
            self._line_step, self._line_at = step, now
        return due

    def set_phase(self, name: str) -> None:
        self.phase = name

    def item_finished(self) -> float:
        """The item's wall seconds; what it took besides its steps feeds the ETAs from now on."""
        took = self.clock() - self.started
        per_step = self.s_per_step
        if per_step is not None and self.step:
            self._overheads.append(max(0.0, took - self.step * per_step))
        self.phase = "finished"
        return took

    @property
    def s_per_step(self) -> float | None:
        times = self._step_times
        if not times:
            return None
        if len(times) == 1:
            return times[0] - self.started
        return (times[-1] - times[0]) / (len(times) - 1)

    @property
    def overhead_s(self) -> float:
        """Mean time an item done so far took besides its steps (0 before the first is done)."""
        return sum(self._overheads) / len(self._overheads) if self._overheads else 0.0

    @property
    def eta_item_s(self) -> float | None:
        per_step = self.s_per_step
        if per_step is None:
            return None
        if self.phase == "finished":
            return 0.0
        overhead = self.overhead_s
        if self.step >= self.steps:  # decoding or writing: what is left of the usual overhead
            overhead = max(0.0, overhead - (self.clock() - self._step_times[-1]))
        return (self.steps - self.step) * per_step + overhead

    @property
    def eta_batch_s(self) -> float | None:
        item = self.eta_item_s
        if item is None:
            return None
        per_item = self.steps * (self.s_per_step or 0.0) + self.overhead_s
        return item + max(0, self.items - self.index) * per_item

    def snapshot(self) -> dict:
        """What the views show (and the heartbeat file holds), plain JSON numbers."""

        def num(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return {
            "item_index": self.index,
            "items": self.items,
            "item": self.item,
            "step": self.step,
            "steps": self.steps,
            "phase": self.phase,
            "s_per_step": num(self.s_per_step),
            "eta_item_s": num(self.eta_item_s),
            "eta_batch_s": num(self.eta_batch_s),
        }


def pace_text(s: dict) -> str:
    """'1.93 s/step, ETA item 23 s, batch 2m41s' of a `Pace.snapshot()` ('' before a step)."""
    if s.get("s_per_step") is None:
        return ""
    return f"{s['s_per_step']:.2f} s/step, ETA item {duration(s['eta_item_s'])}, batch {duration(s['eta_batch_s'])}"


def progress_text(s: dict) -> str:
    """'item 2/5 a-red-circle: step 8/20, 1.93 s/step, ETA item 23 s, batch 2m41s'."""
    where = f"item {s['item_index']}/{s['items']} {s['item']}: "
    if s.get("phase") not in ("denoise", None):
        where += f"{s['phase']}, "
    return where + f"step {s['step']}/{s['steps']}" + (f", {pace_text(s)}" if pace_text(s) else "")
