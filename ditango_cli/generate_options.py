"""The options of `generate` alone: retries, what to show, and how the batch's items reach its
workers (--queue, --lease, --join: runtime/batch_queue.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ditango_cli.choices import QueueChoice, _o
from runtime.batch_queue import LEASE_S
from runtime.config import MIN_LEASE_S


@dataclass
class GenerateArgs:
    retries: Annotated[int, _o("--retries", min=0, help="Try a failed item again up to N times, then go on.")] = 1
    dry_run: Annotated[bool, _o("--dry-run", help="Print what would be launched and exit; runs nothing.")] = False
    quiet: Annotated[bool, _o("--quiet", "-q", help="No progress output.")] = False
    wait_for_lock: Annotated[
        bool, _o("--wait-for-lock", help="If another run owns --out, wait for it to end instead of refusing.")
    ] = False
    queue: Annotated[
        QueueChoice,
        _o(
            "--queue",
            help="shared: every replica, array task and joined worker takes the next item from --out's queue, "
            "longest first; static: a round-robin split fixed at the start.",
        ),
    ] = QueueChoice.shared
    lease: Annotated[
        float,
        _o(
            "--lease",
            min=MIN_LEASE_S,
            help="Seconds a worker's claim on an item lives without renewal; then another worker takes it over.",
        ),
    ] = LEASE_S
    join: Annotated[
        Path | None,
        _o(
            "--join",
            metavar="OUT",
            help="Add workers to the batch running in OUT: its settings are read from there "
            "(give --nodes, --gpus-per-node, --replicas, --executor and Slurm options for the new workers).",
        ),
    ] = None
