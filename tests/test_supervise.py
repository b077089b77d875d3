"""The one supervisor (slurm/supervise.py) with a scripted executor: the retry, blame,
give-up, cancel and relaunch rules that the local launcher, srun steps and sbatch jobs share."""

from __future__ import annotations

from pathlib import Path

from runtime.config import Item, RunConfig
from runtime.errors import OutputWriteError
from runtime.outputs import item_status, mark_running, output_paths, read_record
from runtime.report import item_record
from runtime.video import write_json
from slurm.sharding import shard
from slurm.supervise import STOPPED, Outcome, supervise


def config(out: Path, n: int = 4, retries: int = 1) -> RunConfig:
    items = tuple(Item(f"i{k}", f"a red ball {k}", "", 0, 64, 64, 17, 2, 2.5, index=k, vae_stride=4) for k in range(n))
    return RunConfig("tiny-wan", None, items, out, retries=retries)


class Scripted:
    """Each launch plays the next script entry: {task: ("done" | "fail" | "cancel" | "crash", item ids)}."""

    def __init__(self, cfg: RunConfig, tasks: int, script: list[dict]) -> None:
        self.cfg, self.tasks, self.script, self.launches = cfg, tasks, list(script), []

    def launch(self, tasks, decided):
        self.launches.append((list(tasks), sorted(decided)))
        plan = self.script.pop(0)
        outcomes = []
        for t in tasks:
            kind, fail_ids = plan.get(t, ("done", ()))
            for item in shard(self.cfg.items, t, self.tasks):
                if item.id in decided:
                    continue
                if item.id in fail_ids:
                    mark_running(self.cfg, item)  # the item in flight when its rank died
                    break
                record = item_record(
                    item, model="tiny-wan", status="done", video=f"{item.id}.mp4", latents=None, timing=None
                )
                write_json(output_paths(self.cfg.out_dir, item.id)["sidecar"], record)
            error = None if kind == "done" else f"rank 1 failed: {kind}"
            outcomes.append(Outcome(t, error, 1 if error else None, f"job {t}", kind == "cancel"))
        return outcomes


def test_a_failed_item_is_retried_in_a_relaunch_of_its_task_only(tmp_path):
    cfg = config(tmp_path)
    ex = Scripted(cfg, 2, [{1: ("fail", {"i1"})}, {}])
    said = []
    assert supervise(cfg, ex, 2, said.append).errors == []
    assert ex.launches == [([0, 1], []), ([1], ["i0", "i2"])]  # task 1 again; its settled items not redone
    assert all(item_status(cfg, i) == "done" for i in cfg.items)
    assert said == ["i1 failed (job 1: rank 1 failed: fail); retry 1 of 1"]


def test_an_item_failing_every_attempt_is_given_up_and_the_batch_goes_on(tmp_path):
    cfg = config(tmp_path, retries=1)
    ex = Scripted(cfg, 1, [{0: ("fail", {"i2"})}, {0: ("fail", {"i2"})}, {}])
    said = []
    assert supervise(cfg, ex, 1, said.append).errors == []
    assert said[-1].startswith("i2 failed") and said[-1].endswith("giving it up after 2 attempt(s)")
    record = read_record(output_paths(cfg.out_dir, "i2")["sidecar"])
    assert record["status"] == "failed" and record["attempts"] == 2
    assert [item_status(cfg, i) for i in cfg.items] == ["done", "done", "failed", "done"]
    assert len(ex.launches) == 3 and "i2" in ex.launches[2][1]  # decided: not run a third time


def test_cancelled_is_final_and_a_failure_outside_any_item_is_not_retried(tmp_path):
    cfg = config(tmp_path)
    ex = Scripted(cfg, 1, [{0: ("cancel", {"i1"})}])
    assert supervise(cfg, ex, 1, print).errors == ["job 0 was cancelled: rank 1 failed: cancel"]
    assert len(ex.launches) == 1
    cfg = config(tmp_path / "b")
    ex = Scripted(cfg, 1, [{0: ("crash", ())}])  # no item was running: the model did not load, say
    assert supervise(cfg, ex, 1, print).errors == ["job 0 failed: rank 1 failed: crash"]
    assert len(ex.launches) == 1


def test_an_executor_that_only_submits(tmp_path):
    class Submitting:
        def launch(self, tasks, decided):
            return None

    assert supervise(config(tmp_path), Submitting(), 1, print).submitted


def test_a_damaged_sidecar_reads_as_no_record(tmp_path):
    """Not UTF-8 (a torn write on a shared file system) or not JSON: the item is simply not done."""
    cfg = config(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    output_paths(tmp_path, "i0")["sidecar"].write_bytes(b"\xff\xfe{not json")
    output_paths(tmp_path, "i1")["sidecar"].write_text("{torn")
    assert read_record(output_paths(tmp_path, "i0")["sidecar"]) is None
    assert item_status(cfg, cfg.items[0]) is None and item_status(cfg, cfg.items[1]) is None


def test_an_output_that_cannot_be_written_stops_the_run_without_a_retry(tmp_path):
    """A full disk fails every attempt alike: retrying recomputed the item only to fail again."""
    cfg = config(tmp_path, retries=3)
    full = "OutputWriteError: cannot write i1.mp4: No space left on device"
    ex = Scripted(cfg, 1, [{0: (full, {"i1"})}])
    errors = supervise(cfg, ex, 1, print).errors
    assert len(ex.launches) == 1
    assert errors == [f"i1 failed (job 0: rank 1 failed: {full}); not retried: {STOPPED}"]
    assert [item_status(cfg, i) for i in cfg.items] == ["done", "failed", None, None]


def test_a_failure_that_cannot_be_recorded_stops_the_run(tmp_path, monkeypatch):
    """Bug: recording the failure on a full disk raised a traceback from the supervisor."""
    import slurm.supervise as supervise_mod

    def full(*args, **kwargs):
        raise OutputWriteError("cannot write i1.json: No space left on device")

    cfg = config(tmp_path)
    ex = Scripted(cfg, 1, [{0: ("fail", {"i1"})}])
    monkeypatch.setattr(supervise_mod, "record_failure", full)
    errors = supervise(cfg, ex, 1, print).errors
    assert len(ex.launches) == 1
    assert errors == [
        "i1 failed (job 0: rank 1 failed: fail); the failure could not be recorded "
        f"(cannot write i1.json: No space left on device); {STOPPED}"
    ]
    assert item_status(cfg, cfg.items[1]) == "running"  # not done: a later run makes it again


def test_heartbeat_files_and_their_watch(tmp_path, monkeypatch):
    """A Slurm rank's heartbeat: a count that moves, the step it belongs to, gone when the rank
    returns; the watch names the rank whose count stood still, and forgets a finished one."""
    import time

    from slurm import heartbeat

    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    monkeypatch.setattr(heartbeat, "MIN_STALE_S", 0.0)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    beating = [heartbeat.Heartbeat(tmp_path, r) for r in (0, 1)]
    watch = heartbeat.BeatWatch(tmp_path)
    assert watch.stale(0.3) is None
    beating[1]._stopped.set()  # rank 1 stands still, as a stopped process's thread would
    deadline = time.monotonic() + 10
    while (found := watch.stale(0.3)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found is not None and found[0] == 1 and found[1] > 0.3 and found[2] == "42.0", found
    beating[1].path.unlink()  # returned: its file goes, and it is not stale
    assert watch.stale(0.3) is None
    beating[0].stop()
    assert not beating[0].path.exists()
    (tmp_path / "a-file").touch()
    unmade = heartbeat.Heartbeat(tmp_path / "a-file" / "beats", 0)  # its folder cannot be made
    unmade.stop()  # runs without a file, and stops quietly
    assert (tmp_path / "a-file").is_file()
