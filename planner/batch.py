"""How long a batch takes on several workers (replicas, or replicas times array tasks), given
each item's price in seconds: the schedules the runtime can run, priced as pure functions.

- The shared queue: every worker pulls the next item when it is free, the items ordered
  longest first (Graham's LPT rule: R. L. Graham, "Bounds on multiprocessing timing
  anomalies", SIAM J. Appl. Math. 17(2), 1969: within 4/3 - 1/(3m) of the optimum on m
  workers).
- The static split: item i to worker i % workers, in the batch's order, whatever the others
  have left (slurm/sharding.py `shard` over array tasks, then over replicas: the same
  partition as i % (tasks x replicas)).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence


def _check(seconds: Sequence[float], workers: int) -> None:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    bad = next((s for s in seconds if not (math.isfinite(s) and s >= 0)), None)
    if bad is not None:
        raise ValueError(f"an item's seconds must be finite and >= 0, got {bad}")


def lpt_makespan(seconds: Sequence[float], workers: int) -> float:
    """The shared queue's makespan: longest first, each item to the worker free first (Graham's
    LPT list schedule). 0.0 for no items."""
    _check(seconds, workers)
    loads = [0.0] * min(workers, len(seconds))  # a heap of the busy workers' finishing times
    if not loads:
        return 0.0
    for s in sorted(seconds, reverse=True):
        heapq.heapreplace(loads, loads[0] + s)  # the earliest free worker takes the next longest
    return max(loads)


def round_robin_makespan(seconds: Sequence[float], workers: int) -> float:
    """The static split's makespan: item i to worker i % workers, in the given order; the
    busiest worker's sum. 0.0 for no items."""
    _check(seconds, workers)
    loads = [0.0] * workers
    for i, s in enumerate(seconds):
        loads[i % workers] += s
    return max(loads, default=0.0)


def ideal_makespan(seconds: Sequence[float], workers: int) -> float:
    """A lower bound of every schedule: the longest item, or the work spread evenly."""
    _check(seconds, workers)
    if not seconds:
        return 0.0
    return max(max(seconds), math.fsum(seconds) / workers)


def longest_first(prices: Mapping[str, float]) -> list[str]:
    """The ids by price, highest first; equal prices keep the mapping's order (a stable sort)."""
    return sorted(prices, key=lambda key: -prices[key])
