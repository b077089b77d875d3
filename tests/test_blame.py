"""Blame the rank that failed first, not a survivor that saw it go.

When a rank dies without a word (`kill -9`, the OOM killer) or stops answering (SIGSTOP, a
frozen host), its peers fail too, with 'Connection reset by peer' or a collective timeout.
Those are reactions: the error must name the rank at fault and its log, with the peers'
reactions listed after it. Local runs (slurm/launchers/processes.py), sbatch jobs (`job_failure`) and srun
steps of an allocation (`_step_error`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from runtime.errors import is_peer_failure
from slurm.launchers.processes import GRACE_S, Failure, RankFailed, _stop, blame_order, rank_failed, run_ranks
from tests.conftest import FAST_ARGV

# The CLI and the Slurm modules are imported by the tests that use them: every rank of a
# run_ranks test imports this module (its targets live here), and those imports would cost
# each rank seconds.

FAST = FAST_ARGV
STEP_TIMEOUT_S = 10
FAULT_MARGIN_S = 20  # detection, the blame window, stopping the ranks, the report, on a loaded machine
TIMEOUT_S = 30  # process groups of the run_ranks tests

# What gloo says on a survivor (one line of it, as a rank reports its error).
RESET = (
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13479: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)
TIMED_OUT = (
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms "
    "for recv operation to complete"
)


# The ordering itself -------------------------------------------------------------------


def test_a_real_cause_is_blamed_before_any_peer_reaction_whenever_it_was_seen():
    """Bug: the first error message to arrive was blamed, a survivor's 'Connection reset by peer',
    although the process that died (seen later) was the cause."""
    reset = Failure(1, "peer", RESET, at=10.0)
    killed = Failure(2, "exit", "process killed by signal 9 (SIGKILL) without an error", at=10.2)
    raised = Failure(3, "error", "ValueError: bad shape", at=10.5)
    assert [f.rank for f in blame_order([raised, reset, killed])] == [2, 3, 1]
    # Without a real cause the first reaction is all there is.
    reactions = [Failure(3, "peer", TIMED_OUT, at=12.0), Failure(0, "peer", RESET, at=11.0)]
    assert [f.rank for f in blame_order(reactions)] == [0, 3]
    # A stopped rank's failure dates from its last heartbeat, before its peers' timeouts.
    stopped = Failure(1, "stopped", "stopped answering", at=3.0)
    assert blame_order([Failure(0, "peer", TIMED_OUT, 13.0), stopped])[0] is stopped


def test_the_error_names_the_cause_and_its_log_then_the_reactions_briefly_on_one_line():
    killed = Failure(2, "exit", "process killed by signal 9 (SIGKILL) without an error", at=10.2)
    exc = rank_failed([Failure(1, "peer", RESET, 10.0), Failure(3, "peer", TIMED_OUT, 10.4), killed], Path("logs"))
    assert isinstance(exc, RankFailed) and exc.rank == 2
    assert str(exc) == (
        "rank 2 failed: process killed by signal 9 (SIGKILL) without an error (log: logs/rank-2.log); "
        "then rank 1: RuntimeError: Read error [127.0.0.1]:13479: Connection reset by peer, "
        "rank 3: RuntimeError: Timed out waiting 10000ms for recv operation to complete"
    )
    assert str(RankFailed(0, "ValueError: x")) == "rank 0 failed: ValueError: x"


# run_ranks, without the CLI ---------------------------------------------------------------

PEERS_NOTICE_AFTER_S = 0.5  # after the supervisor saw the death, within the old 1 s wait for a message


def _killed_before_its_peers_notice(rank, world, events, victim):
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(PEERS_NOTICE_AFTER_S)
    dist.barrier()  # the survivors find the dead peer here: connection reset / closed


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_death_seen_before_any_message_is_still_blamed_on_the_dead_rank():
    """Bug: the supervisor noticed rank 1's exit first, then took the first error message to
    arrive within a second as the explanation: a survivor's 'Connection reset by peer'."""
    with pytest.raises(RankFailed) as failed:
        run_ranks(_killed_before_its_peers_notice, 3, (1,), timeout_s=TIMEOUT_S)
    assert failed.value.rank == 1, failed.value
    assert failed.value.message == "process killed by signal 9 (SIGKILL) without an error"
    assert all(r != 1 and is_peer_failure(m) for r, m in failed.value.then), failed.value


def _process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stopped_rank_is_ended_at_once():
    """SIGTERM is not delivered to a stopped process until SIGCONT: terminate-then-wait left a
    SIGSTOPped rank until the SIGKILL after GRACE_S."""
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
    proc.start()
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while _process_state(proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _process_state(proc.pid) == "T"
    start = time.monotonic()
    _stop([proc])
    assert time.monotonic() - start < GRACE_S / 2
    assert proc.exitcode == -signal.SIGTERM  # it got the SIGTERM, not the fallback SIGKILL


# The CLI, 4 local ranks -----------------------------------------------------------------


def _run_with_fault(runner, out: Path, monkeypatch, rank: int, kind: str) -> tuple[str, float]:
    """A 4-rank ring run in which `rank` fails after step 1; (the item's error, seconds from the
    fault to the end)."""
    from ditango_cli.app import app

    fired = out.parent / "fired"
    monkeypatch.setenv("DITANGO_FAULT_INJECT", f"{rank}:1")
    monkeypatch.setenv("DITANGO_FAULT_KIND", kind)
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(fired))  # its mtime says when the fault fired
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--nodes",
        "1",
        "--gpus",
        "4",
        "--parallel",
        "ring",
        "--executor",
        "local",
        "--retries",
        "0",
        "--timeout",
        str(STEP_TIMEOUT_S),
        *FAST,
    ]
    result = runner.invoke(app, args)
    elapsed = time.time() - fired.stat().st_mtime
    assert result.exit_code == 1, result.stderr
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["status"] == "failed"
    assert f"(first: {item['error']};" in result.stderr  # the whole error, on the CLI's one line
    return item["error"], elapsed


def _reactions(error: str) -> dict[int, str]:
    """The ranks listed after '; then ', with their messages."""
    _, then, listed = error.partition("; then ")
    assert then, error
    return {int(r): m for r, m in re.findall(r"rank (\d+): (.*?)(?=, rank \d+: |$)", listed)}


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [0, 2])
@pytest.mark.e2e
def test_a_rank_killed_with_sigkill_is_blamed_not_a_survivor(runner, tmp_path, monkeypatch, victim):
    """Bug: after `kill -9` of one rank, the error named a survivor ('Connection reset by peer')
    and pointed at the survivor's log."""
    out = tmp_path / "out"
    error, elapsed = _run_with_fault(runner, out, monkeypatch, victim, "kill")
    log = out / "logs" / f"rank-{victim}.log"
    assert error.startswith(
        f"rank {victim} failed: process killed by signal 9 (SIGKILL) without an error (log: {log}); then "
    ), error
    assert re.findall(r"rank-\d+\.log", error) == [f"rank-{victim}.log"]
    reactions = _reactions(error)
    assert reactions and set(reactions) <= {0, 1, 2, 3} - {victim}, error
    assert all(is_peer_failure(m) for m in reactions.values()), error
    assert elapsed <= FAULT_MARGIN_S, elapsed  # no timeout involved: the death is seen at once


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_stopped_rank_is_blamed_as_not_answering(runner, tmp_path, monkeypatch):
    """Bug: a SIGSTOPped rank raises nothing and never exits; its peers' collective timeouts
    were blamed. Its heartbeat stops with it, which names it."""
    out = tmp_path / "out"
    error, elapsed = _run_with_fault(runner, out, monkeypatch, 1, "stop")
    assert re.match(
        rf"rank 1 failed: stopped answering \(no heartbeat for \d+ s: a stopped process, e\.g\. SIGSTOP\) "
        rf"\(log: {re.escape(str(out / 'logs' / 'rank-1.log'))}\); then ",
        error,
    ), error
    reactions = _reactions(error)
    assert reactions and set(reactions) <= {0, 2, 3} and any("Timed out" in m for m in reactions.values()), error
    assert elapsed <= STEP_TIMEOUT_S + FAULT_MARGIN_S, elapsed  # and the stopped process did not hold it up


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_writer_stopped_while_writing_ends_the_wait_after_the_step_timeout_and_is_retried(
    runner, tmp_path, monkeypatch
):
    """Bug: with rank 0 stopped (SIGSTOP) while it wrote the video, its peers waited on it under
    the setup timeout (1,800 s by default) although its heartbeat was stale after seconds."""
    from ditango_cli.app import app

    out, fired = tmp_path / "out", tmp_path / "fired"
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "0:write")
    monkeypatch.setenv("DITANGO_FAULT_KIND", "stop")
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(fired))  # once: the retry goes through
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--gpus",
        "2",
        "--executor",
        "local",
        "--timeout",
        str(STEP_TIMEOUT_S),
        "--setup-timeout",
        "600",
        *FAST,
    ]
    result = runner.invoke(app, [a for a in args if a != "--quiet"])  # the retry line is progress output
    assert result.exit_code == 0, result.stderr
    (said,) = [line for line in result.stderr.splitlines() if " failed (" in line]
    assert re.match(r"0000-\w+ failed \(rank 0 failed: stopped answering \(no heartbeat for \d+ s", said), said
    assert said.endswith("retry 1 of 1"), said
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["status"] == "done"
    elapsed = time.time() - fired.stat().st_mtime  # the stop, the wait, the retry's whole run
    assert elapsed <= STEP_TIMEOUT_S + 2 * FAULT_MARGIN_S, elapsed


# Slurm: what srun and submitit leave ----------------------------------------------------

# Task 0's stderr in a job whose task 2 was killed with SIGKILL (srun's messages come there, in
# the order the tasks ended); as Slurm 22.05 wrote it, shortened.
SRUN_KILLED_2 = """\
[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer.
srun: error: node2: task 2: Killed
srun: launch/slurm: _step_signal: Terminating StepId=56118826.0
slurmstepd-node1: error: *** STEP 56118826.0 ON node1 CANCELLED AT 2026-12-01T13:43:57 ***
srun: error: node1: task 1: Terminated
srun: error: node2: task 3: Exited with exit code 1
srun: error: node1: task 0: Exited with exit code 1
srun: Force Terminated StepId=56118826.0
"""
# A rank that hung: its peer timed out first; srun's SIGKILL of the hung rank came after.
SRUN_HUNG_1 = """\
srun: error: node1: task 0: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=7.0
srun: error: node1: task 1: Killed
"""


def _failed_trace(line: str) -> Exception:
    return Exception(f"Job (task=0) failed during processing with trace:\n---\nTraceback ...\n{line}\n---\n")


def _no_output(task: int) -> Exception:
    return Exception(
        f"Job 9 (task: {task}) with path /x/9_{task}_result.pkl\nhas not produced any output (state: FAILED)\n"
        "Error stream produced:\n----------------------------------------\nLoading weights: 100%| 22/22"
    )


def _fake_job(tmp_path: Path, srun_text: str, exceptions: list) -> SimpleNamespace:
    """What `job_failure` reads of a submitit job: per task, the exception and the stderr path."""
    tasks = []
    for t, exc in enumerate(exceptions):
        stderr = tmp_path / f"9_{t}_log.err"
        stderr.write_text(srun_text if t == 0 else "")
        result = tmp_path / f"9_{t}_result.pkl"
        result.unlink(missing_ok=True)
        if exc is None:  # a task that returned left its result
            result.write_bytes(b"")
        paths = SimpleNamespace(stderr=stderr, result_pickle=result)
        tasks.append(SimpleNamespace(exception=lambda exc=exc: exc, paths=paths))
    return SimpleNamespace(num_tasks=len(tasks), task=lambda t: tasks[t], paths=tasks[0].paths)


def test_srun_task_ends_in_the_order_srun_reported_them():
    from slurm.job_errors import srun_task_ends

    assert srun_task_ends(SRUN_KILLED_2) == [
        ((2,), "Killed"),
        ((1,), "Terminated"),
        ((3,), "Exited with exit code 1"),
        ((0,), "Exited with exit code 1"),
    ]
    assert srun_task_ends("srun: error: node1: tasks 0-1,3: Terminated\n") == [((0, 1, 3), "Terminated")]


def test_a_job_blames_the_task_killed_first_not_a_peer_reaction(tmp_path):
    """Bug: a task killed by SIGKILL leaves no exception, so a survivor's 'Connection reset by
    peer' was the job's error, with no rank."""
    from slurm.job_errors import job_failure

    reset = _failed_trace(RESET)
    job = _fake_job(tmp_path, SRUN_KILLED_2, [reset, _no_output(1), _no_output(2), reset])
    error, rank = job_failure(job)
    assert rank == 2
    assert error == (
        f"rank 2 was killed by a signal, without an exception (srun: task 2: Killed; log: {tmp_path / '9_2_log.err'})"
    )
    # Task 1, killed by srun after task 2's end, is not a cause; nor is a hung rank srun killed last.
    hung = _fake_job(tmp_path, SRUN_HUNG_1, [_failed_trace(TIMED_OUT), _no_output(1)])
    assert job_failure(hung) == (TIMED_OUT, None)
    # A task's own exception is still blamed, first by srun's order.
    raised = _failed_trace("slurm.faults.RuntimeError: injected fault on rank 3 after step 2")
    srun = "srun: error: node2: task 3: Exited with exit code 1\nsrun: error: node1: task 1: Exited with exit code 1\n"
    both = _fake_job(tmp_path, srun, [None, _failed_trace("ValueError: later"), None, raised])
    assert job_failure(both) == ("RuntimeError: injected fault on rank 3 after step 2", 3)


def test_a_requeued_job_is_judged_by_its_last_attempt(tmp_path):
    """Bug: a job requeued at its time limit (submitit's checkpoint on SIGUSR2) keeps one log
    across attempts; srun's report of the first attempt's signalled tasks made a job whose
    last attempt finished read as failed ("rank 0: User defined signal 2")."""
    from slurm.job_errors import ATTEMPT_MARK, job_failure

    first = "srun: error: node1: task 0: User defined signal 2\nsrun: error: node2: task 1: User defined signal 2\n"
    finished = _fake_job(tmp_path, f"{ATTEMPT_MARK}\n{first}{ATTEMPT_MARK}\nlast attempt's output\n", [None, None])
    assert job_failure(finished) == (None, None)
    # The last attempt's own failure is still found, and blamed on its rank.
    again = f"{ATTEMPT_MARK}\n{first}{ATTEMPT_MARK}\nsrun: error: node2: task 1: Killed\n"
    killed = _fake_job(tmp_path, again, [_failed_trace(RESET), _no_output(1)])
    assert job_failure(killed)[1] == 1


def test_an_srun_step_blames_the_rank_killed_first_not_a_peer_reaction(tmp_path):
    """Bug: in an allocation, only the ranks that raised left a .error file, all peers' reactions,
    and the first of those was blamed."""
    from slurm.launchers.srun import _step_error

    for r in range(4):
        (tmp_path / f"task-0-rank-{r}.log").write_text("")
    for r in (3, 1):
        (tmp_path / f"task-0-rank-{r}.error").write_text(f"rank {r}: {RESET}\n")
        time.sleep(0.05)  # written in this order
    (tmp_path / "task-0-srun.log").write_text(SRUN_KILLED_2)
    error, rank = _step_error(tmp_path, 0, 143)
    assert rank == 2
    assert error == (
        f"rank 2: killed by a signal, without an error (srun: task 2: Killed; log: {tmp_path / 'task-0-rank-2.log'})"
    )
    (tmp_path / "task-0-srun.log").unlink()  # without srun's messages: the first peer, as before
    assert _step_error(tmp_path, 0, 143) == (f"rank 3: {RESET}", 3)


# As tests/test_slurm.py's: skipped without a running cluster, except in CI (a string condition:
# evaluated when the test is collected, not when a rank imports this module).
@pytest.mark.slurm
def test_a_job_whose_rank_is_killed_with_sigkill_names_that_rank(runner, tmp_path, monkeypatch):
    """4 tasks on 2 nodes; rank 2 sends itself SIGKILL. The job's error is rank 2's death (srun's
    'task 2: Killed'), not a survivor's 'Connection reset by peer'."""
    from ditango_cli.app import app
    from tests.conftest import cluster_up
    from tests.test_slurm import SMALL as SLURM_SMALL

    assert cluster_up(), "Slurm is not running: .ci/run must start scripts/local-slurm.sh"
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "2:1")  # sbatch exports the environment to the job
    monkeypatch.setenv("DITANGO_FAULT_KIND", "kill")
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--nodes",
        "2",
        "--gpus",
        "2",
        "--parallel",
        "ring",
        "--retries",
        "0",
        "--timeout",
        str(STEP_TIMEOUT_S),
        *SLURM_SMALL,
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.stderr
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["status"] == "failed"
    # srun's "task 2: Killed" names the death; when a loaded slurmd reports it after the heartbeat
    # watch has seen rank 2 silent for its limit, the watch names it. Never a survivor.
    killed = r"rank 2 was killed by a signal, without an exception \(srun: task 2: Killed; log: \S+_2_log\.err\)"
    silent = r"rank 2 failed: stopped answering \(no heartbeat for \d+ s"
    assert re.search(rf"job \S+: ({killed}|{silent})", item["error"]), item["error"]


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["sbatch", "srun"])
def test_a_slurm_writer_stopped_while_writing_is_named_and_retried(runner, tmp_path, monkeypatch, launcher):
    """Bug: with rank 0 of a job stopped (SIGSTOP) while it wrote the video, its peers waited on it
    under the setup timeout. Its heartbeat (a file of the job's folder) stands still: the launcher
    ends the job (or the srun step) after the step timeout, blames rank 0 and retries."""
    import subprocess

    from ditango_cli.app import app
    from slurm.heartbeat import MIN_STALE_S
    from tests.conftest import cluster_up
    from tests.test_slurm import SMALL, STEPS

    assert cluster_up(), "Slurm is not running: .ci/run must start scripts/local-slurm.sh"
    out, fired = tmp_path / "out", tmp_path / "fired"
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "0:write")  # sbatch and srun export the environment
    monkeypatch.setenv("DITANGO_FAULT_KIND", "stop")
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(fired))
    launch = SMALL if launcher == "sbatch" else STEPS  # an allocation's steps take no job options
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--nodes",
        "2",
        "--gpus",
        "1",
        "--timeout",
        str(STEP_TIMEOUT_S),
        "--setup-timeout",
        "600",
        *launch,
    ]
    args = [a for a in args if a != "--quiet"]  # the retry line is progress output
    if launcher == "sbatch":
        result = runner.invoke(app, args)
        said, code = result.stderr, result.exit_code
    else:  # inside an allocation: its steps
        cli = [sys.executable, "-c", "from ditango_cli.app import main; main()"]
        alloc = ["salloc", "--nodes", "2", "--ntasks-per-node", "1", "--partition", "debug", "--time", "10"]
        run = subprocess.run([*alloc, *cli, *args], capture_output=True, text=True, timeout=600)
        said, code = run.stderr, run.returncode
    assert code == 0, said
    (line,) = [ln for ln in said.splitlines() if " failed (" in ln]
    assert re.search(r"failed \((job \S+: |step 0: )?rank 0 failed: stopped answering \(no heartbeat for \d+ s", line)
    assert line.endswith("retry 1 of 1"), line
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["status"] == "done"
    elapsed = time.time() - fired.stat().st_mtime  # the stop, the wait, ending the job, the retry's job
    assert elapsed <= max(STEP_TIMEOUT_S, MIN_STALE_S) + 3 * FAULT_MARGIN_S, elapsed
