"""How the local launcher (slurm/launchers/processes.py) starts its ranks: as torchrun starts its workers,
each in a process session of its own, with the compute threads torchrun would give it."""

from __future__ import annotations

import os

import pytest

from slurm.launchers.processes import run_ranks
from slurm.rank_process import rank_threads


def _where_am_i(rank, world, events):
    import torch

    return os.getpid(), os.getsid(0), os.getpgid(0), torch.get_num_threads()


@pytest.mark.distributed
def test_each_rank_leads_a_process_session_of_its_own(monkeypatch):
    """Where the kernel shares CPU time by session (autogroup), ranks left in the launching
    shell's session split one share between them while torchrun's workers get one each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ranks = run_ranks(_where_am_i, 2, timeout_s=60)
    for pid, session, group, threads in ranks:
        assert session == pid and group == pid  # a session (and process group) leader
        assert threads == 1
    assert os.getsid(0) not in {session for _, session, _, _ in ranks}


def test_threads_per_rank_follow_omp_num_threads_else_the_usable_cores(monkeypatch):
    usable = len(os.sched_getaffinity(0))
    assert rank_threads(2, {"OMP_NUM_THREADS": "3"}) == 3
    assert rank_threads(2, {}) == max(1, usable // 2)
    assert rank_threads(4 * usable, {"OMP_NUM_THREADS": ""}) == 1
    for wrong in ("zero", "0", "\u00b2", "-2"):  # not a count: the cores decide
        assert rank_threads(1, {"OMP_NUM_THREADS": wrong}) == usable
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})  # a Slurm step's cpuset
    assert rank_threads(2, {}) == 3
