"""How a batch's items are split over Slurm array tasks and model replicas with --queue static
(under the shared queue, the default, every task and replica pulls from one queue instead:
runtime/batch_queue.py; each then gets every item, of which it makes those it claims).

Both are pure functions of the item list, so every rank of every task computes the same
split without talking to the others; items keep their ids (resume skips finished ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from basics.errors import ConfigError

T = TypeVar("T")


def shard(items: Sequence[T], index: int, count: int) -> list[T]:
    """Round-robin share `index` of `count` (array task or replica): items index, index+count, ...

    Round-robin rather than contiguous blocks keeps shards balanced when a batch mixes
    sizes that were written in order (e.g. all short clips first)."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}")
    return list(items[index::count])


def share(cfg, index: int, count: int) -> list:
    """The items task or replica `index` of `count` may make: its round-robin share with --queue
    static, every item under the shared queue."""
    return list(cfg.items) if cfg.queue.shared else shard(cfg.items, index, count)


def replica_of(rank: int, world_size: int, replicas: int) -> tuple[int, int]:
    """(replica index, rank inside the replica) for --replicas R: R equal, contiguous rank
    blocks (so a replica stays on as few nodes as possible)."""
    if replicas < 1 or world_size % replicas:
        raise ConfigError(f"--replicas {replicas} must divide the {world_size} ranks")
    size = world_size // replicas
    return rank // size, rank % size
