"""Files a run reads that a user, a cache or another run put there: LoRAs and weights taken
as safetensors by their bytes whatever their name (a pickle is never unpickled), LoRAs in the
Hugging Face cache, relative paths beside the file that names them, `~user` paths, the output
folder's bookkeeping of another kind, and what `status` prints of it. Each case once ran a
pickle, picked another file, gave a traceback or hung."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditango_cli.app import app

from .conftest import FAST_ARGV, refused
from .test_lora import make_lora

DITANGO = Path(sys.executable).parent / "ditango"
COMMIT = "c" * 40


class Trap:
    """Unpickling it touches `marker`: its file appears only if a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def lora(saved_model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lora")
    make_lora(saved_model_dir, folder, seed=4)
    return folder / "pytorch_lora_weights.safetensors"


@pytest.fixture
def never_unpickled(monkeypatch):
    """Every way a pickle is read in this process fails the test (the marker file catches any
    other: a subprocess, a loader holding its own reference)."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a pickle was read")

    for owner, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(owner, name, refuse)
    return calls


def a_pickle(folder: Path, kind: str, marker: Path) -> Path:
    """A pickle of `kind`: a plain one holding a Trap, or what torch.save writes (a zip archive)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("trap.pkl" if kind == "pickle" else "trap.pt")
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"transformer.blocks.0.attn1.to_q.lora_A.weight": Trap(marker)}, protocol=4))
    else:
        torch.save({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24)}, path)
    return path


def add_to_cache(cache: Path, repo_id: str, files: dict[str, Path], commit: str = COMMIT) -> Path:
    """`files` (name -> bytes' file) as snapshot `commit` of `repo_id`, laid out as huggingface_hub
    lays it out: blobs/<sha256> (no extension), snapshots/<commit>/<name> links to them, refs/main."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, blob)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "hub"


def check(runner, model: Path, *args: str, out: Path | None = None):
    out_args = ["--out", str(out)] if out is not None else []
    return runner.invoke(app, ["check", "--model", str(model), *out_args, "--device", "cpu", *args])


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
@pytest.mark.parametrize("how", ["named", "link", "link to a link", "folder", "cache", "jsonl"])
def test_a_pickle_lora_is_refused_unread_under_any_name(
    runner, tmp_path, saved_model_dir, cache, never_unpickled, kind, how
):
    """The bug: `x.safetensors` linking to a torch.save file passed `check` and was loaded with
    torch.load. A LoRA is safetensors by its bytes, whatever its name or links say."""
    marker = tmp_path / "unpickled"
    trap = a_pickle(tmp_path / "files", kind, marker)
    named = tmp_path / "style.safetensors"
    if how == "named":
        shutil.copyfile(trap, named)
    elif how in ("link", "jsonl"):
        named.symlink_to(trap)
    elif how == "link to a link":
        (tmp_path / "middle.safetensors").symlink_to(trap)
        named.symlink_to(tmp_path / "middle.safetensors")
    elif how == "folder":
        named = tmp_path / "adapter"
        named.mkdir()
        (named / "adapter_model.safetensors").symlink_to(trap)
    else:
        add_to_cache(cache, "acme/style", {"pytorch_lora_weights.safetensors": trap})
    source = "acme/style" if how == "cache" else str(named)
    if how == "jsonl":
        batch = tmp_path / "batch.jsonl"
        batch.write_text(json.dumps({"prompt": "a", "loras": ["style.safetensors"]}) + "\n")
        result = check(runner, saved_model_dir, "--prompts", str(batch))
    else:
        result = check(runner, saved_model_dir, "--prompt", "a", "--lora", source)
    refused(result, "is a pickle (torch.save) file, whatever its name")
    assert not marker.exists() and not never_unpickled


@pytest.mark.parametrize("component", ["transformer", "text_encoder", "vae"])
def test_model_weights_that_are_a_pickle_are_refused_unread(runner, tmp_path, saved_model_dir, component):
    """A model folder's `.safetensors` that is a pickle, or links to one: refused in one line by
    its bytes, for every component, before anything loads."""
    model = tmp_path / "model"
    shutil.copytree(saved_model_dir, model)
    marker = tmp_path / "unpickled"
    trap = a_pickle(tmp_path / "files", "torch.save", marker)
    (weights,) = (model / component).glob("*.safetensors")
    weights.unlink()
    weights.symlink_to(trap)
    refused(check(runner, model, "--prompt", "a"), str(weights), "is a pickle (torch.save) file")
    assert not marker.exists()


def test_a_lora_in_the_hf_cache_loads_as_the_same_file_given_by_path(runner, saved_model_dir, cache, lora, monkeypatch):
    """The bug: a cached snapshot's file links into blobs/, whose names have no extension; the
    resolved link was taken for a pickle and the repo never loaded. Offline and at a commit too."""
    from diffusers import WanPipeline

    from runtime.models.adapters import Adapter, AdapterBank, lora_state_dict, resolve

    snapshot = add_to_cache(cache, "acme/style", {"pytorch_lora_weights.safetensors": lora})

    def item_lora(*extra: str) -> dict:
        result = check(runner, saved_model_dir, "--prompt", "a", "--json", *extra)
        assert result.exit_code == 0, result.stderr[-2000:]
        return json.loads(result.stdout)["items"][0]["loras"][0]

    by_path, by_repo = item_lora("--lora", str(lora)), item_lora("--lora", "acme/style:0.5")
    assert by_repo["path"] == str(snapshot / "pytorch_lora_weights.safetensors")
    assert by_repo["sha256"] == by_path["sha256"] and by_repo["scale"] == 0.5
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert item_lora("--lora", f"acme/style@{COMMIT}")["sha256"] == by_path["sha256"]
    cached, direct = resolve(Adapter("acme/style")), resolve(Adapter(str(lora)))
    first, second = lora_state_dict(WanPipeline, cached), lora_state_dict(WanPipeline, direct)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    weights = []
    for adapter in (cached, direct):  # loaded and fused by diffusers, as a rank does
        pipe = WanPipeline.from_pretrained(saved_model_dir, local_files_only=True)
        AdapterBank(pipe, [(adapter,)])
        weights.append(pipe.transformer.state_dict())
    plain = WanPipeline.from_pretrained(saved_model_dir, local_files_only=True).transformer.state_dict()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in plain)
    assert any(not torch.equal(weights[0][k], plain[k]) for k in plain), "the LoRA changed the weights"


def test_relative_loras_resolve_beside_the_file_that_names_them(runner, tmp_path, saved_model_dir, lora, monkeypatch):
    """The bug: a JSONL line's relative "loras" path was taken from the current folder, where
    another LoRA of the same name ran without a word. A run file's likewise."""
    files, elsewhere = tmp_path / "files", tmp_path / "elsewhere"
    for folder in (files, elsewhere):
        folder.mkdir()
    shutil.copyfile(lora, files / "style.safetensors")
    tensors = load_file(str(lora))
    save_file({k: v * 2 for k, v in tensors.items()}, str(elsewhere / "style.safetensors"))
    (files / "batch.jsonl").write_text(json.dumps({"prompt": "a", "loras": ["style.safetensors:0.5"]}) + "\n")
    (files / "run.toml").write_text('prompt = "a"\n[items]\nlora = ["style.safetensors:0.5"]\n')
    (files / "missing.jsonl").write_text(json.dumps({"prompt": "a", "loras": ["gone.safetensors"]}) + "\n")
    monkeypatch.chdir(elsewhere)  # the current folder has a LoRA of the same name
    for source in (["--prompts", "../files/batch.jsonl"], ["--config", "../files/run.toml"]):
        result = check(runner, saved_model_dir, "--json", *source)
        assert result.exit_code == 0, result.stderr[-2000:]
        (used,) = json.loads(result.stdout)["items"][0]["loras"]
        assert Path(used["path"]).resolve() == (files / "style.safetensors").resolve() and used["scale"] == 0.5
    line = refused(check(runner, saved_model_dir, "--prompts", "../files/missing.jsonl"), "no such file or folder")
    assert "files/gone.safetensors" in line and "missing.jsonl line 1" in line


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda t: {k: v[:2] if "lora_A" in k else v for k, v in t.items()}, "lora_A has rank 2, its lora_B rank 4"),
        (lambda t: {k: v[0] if "lora_A" in k else v for k, v in t.items()}, "lora_A is 1-D"),
        (lambda t: {k: v[None] if "lora_A" in k else v for k, v in t.items()}, "lora_A is 3-D"),
        (lambda t: {k: v.to(torch.int32) if "lora_B" in k else v for k, v in t.items()}, "holds int32 numbers"),
        (lambda t: {k: v.clone().fill_(float("nan")) for k, v in t.items()}, "non-finite values"),
        (lambda t: {k: v for k, v in t.items() if "lora_B" not in k}, "has a lora_A and no lora_B"),
        (lambda t: {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in t.items()}, "a LoRA (rank 0)"),
        ({"transformer.r": 8}, "has rank 4, its lora_adapter_metadata says 8"),
        ({"transformer.r": "x"}, "lora_adapter_metadata's r must be a positive integer, got 'x'"),
        ({"transformer.target_modules": ["to_q"]}, "lora_adapter_metadata's target_modules leave out"),
        ({"transformer.bogus": 1}, "its lora_adapter_metadata is no peft LoRA config"),
    ],
)
def test_a_lora_that_cannot_be_applied_is_refused_before_the_run(
    runner, tmp_path, saved_model_dir, lora, damage, needle
):
    """The pre-check compared only the in/out sizes of 2-D factors, and not the peft config the
    file carries (which diffusers builds the adapter from, not from the tensors): these started
    the run and failed at load, with exit 1 and no video, or left a layer's weights unused."""
    from safetensors import safe_open

    bad = tmp_path / "bad.safetensors"
    with safe_open(str(lora), framework="pt") as f:
        metadata = f.metadata()  # diffusers' peft config of the adapter, kept with its tensors
    tensors = load_file(str(lora))
    if isinstance(damage, dict):  # the config changed, the tensors not
        config = json.loads(metadata["lora_adapter_metadata"]) | damage
        save_file(tensors, str(bad), metadata={**metadata, "lora_adapter_metadata": json.dumps(config)})
    else:
        save_file(damage(tensors), str(bad), metadata=metadata)
    for command in ("check", "generate"):
        out = tmp_path / command
        result = runner.invoke(
            app,
            [
                command,
                "--model",
                str(saved_model_dir),
                "--prompt",
                "a",
                "--lora",
                str(bad),
                "--out",
                str(out),
                "--device",
                "cpu",
            ],
        )
        refused(result, needle)
        assert not out.exists()


def test_the_loras_of_an_item_are_bounded(runner, tmp_path, saved_model_dir, lora):
    """The bug: a line with 10,000 "loras" entries ran for minutes before saying anything."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": "a", "loras": [str(lora)] * 10_000}) + "\n")
    refused(check(runner, saved_model_dir, "--prompts", str(batch)), '"loras" names 10000 LoRAs', "at most 16")
    many = [arg for _ in range(17) for arg in ("--lora", str(lora))]
    refused(check(runner, saved_model_dir, "--prompt", "a", *many), "names 17 LoRAs")


NOBODY = "~no-such-user-of-ditango"
HOMELESS = {
    "--lora": ["--prompt", "a", "--lora", f"{NOBODY}/style.safetensors"],
    "--out": ["--prompt", "a", "--out", f"{NOBODY}/out"],
    "--prompts": ["--prompts", f"{NOBODY}/batch.txt"],
    "--image": ["--prompt", "a", "--model", "wan2.1-i2v-14b-480p", "--image", f"{NOBODY}/first.png"],
    "--model": ["--prompt", "a", "--model", f"{NOBODY}/model"],
    "--model-root": ["--prompt", "a", "--model", "wan2.1-1.3b", "--model-root", f"{NOBODY}/models"],
    "--config": ["--config", f"{NOBODY}/run.toml"],
    "jsonl image": ["--model", "wan2.1-i2v-14b-480p", "--prompts", {"prompt": "a", "image": f"{NOBODY}/first.png"}],
    "jsonl loras": ["--prompts", {"prompt": "a", "loras": [f"{NOBODY}/style.safetensors"]}],
}


@pytest.mark.parametrize("case", list(HOMELESS))
def test_a_home_folder_of_no_user_is_one_line(runner, tmp_path, case):
    """The bug: `--lora '~nosuchuser/x'` ended in a RuntimeError from Path.expanduser."""
    args = HOMELESS[case]
    if isinstance(args[-1], dict):
        batch = tmp_path / "batch.jsonl"
        batch.write_text(json.dumps(args[-1]) + "\n")
        args = [*args[:-1], str(batch)]
    result = runner.invoke(app, ["check", "--device", "cpu", *args])
    refused(result, NOBODY, "names no user with a home folder here")


@pytest.mark.parametrize("entry", [".ditango", ".ditango/progress", ".ditango/lock", ".ditango/jobs.json", "logs"])
def test_bookkeeping_of_another_kind_refuses_a_run_in_one_line(runner, tmp_path, entry):
    """The bugs: `OUT/.ditango` a file ended generate with FileExistsError; `.ditango/lock` a
    FIFO was "taken over" and its read then blocked for ever. Nothing is written. The lock's
    case runs as its own process: a read of the FIFO would hang it, not this test run."""
    out = tmp_path / "out"
    (out / entry).parent.mkdir(parents=True, exist_ok=True)
    folder_wanted = entry in (".ditango", ".ditango/progress", "logs")
    if folder_wanted:
        (out / entry).write_text("not a folder")
    else:
        os.mkfifo(out / entry)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    argv = ["generate", "--prompt", "a", "--out", str(out), *FAST_ARGV]
    if entry == ".ditango/lock":
        ran = subprocess.run([str(DITANGO), *argv], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 2, ran.stderr[-2000:]
        (line,) = ran.stderr.strip().splitlines()
    else:
        line = refused(runner.invoke(app, argv))
    kind = "a regular file, not a folder" if folder_wanted else "a FIFO (named pipe), not a regular file"
    assert line.startswith(f"error: {out / entry} is {kind}"), line
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_a_lock_that_is_a_fifo_is_never_read(tmp_path):
    """Taking over a damaged lock read the file it set aside: a FIFO there blocked for ever."""
    from runtime.lock import FolderLock
    from runtime.outputs import state_dir

    out = tmp_path / "out"
    state_dir(out).mkdir(parents=True)
    os.mkfifo(state_dir(out) / "lock")
    lock = FolderLock(out)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (lock.holder(), lock._break(None), lock._ours(), done.set()), daemon=True)
    worker.start()
    worker.join(30)
    if not done.is_set():  # unblock the reader before failing
        for fifo in state_dir(out).glob("*lock*"):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert done.is_set(), "a FIFO lock was read"
    assert not (state_dir(out) / "lock").exists()


def test_status_prints_no_control_character_from_the_files_it_reads(runner, tmp_path):
    """The bug: a heartbeat's `host` and `state` reached the terminal as they were: escape
    sequences set the window's title and cleared the screen."""
    import time

    from runtime.outputs import state_dir

    out = tmp_path / "out"
    progress = state_dir(out) / "progress"
    progress.mkdir(parents=True)
    hostile = "\x1b]0;owned\x07\x1b[2J\x9b31m\r\u202e"
    for name, state in (("task-0", "running"), (f"task-1{hostile}", f"ended{hostile}")):
        beat = {
            "state": state,
            "updated": time.time(),
            "pid": 4_000_000,
            "host": f"node{hostile}",
            "done": 1,
            "failed": 0,
            "item_index": 1,
            "items": 2,
            "item": f"a{hostile}",
            "step": 1,
            "steps": 3,
        }
        (progress / f"{name}.json").write_text(json.dumps(beat))
    (out / "a.json").write_text(
        json.dumps({"schema": 1, "id": f"a{hostile}", "status": "failed", "error": f"boom{hostile}"})
    )
    for command in ("status", "report"):
        result = runner.invoke(app, [command, str(out)])
        assert result.exit_code in (0, 1), result.stderr[-2000:]
        shown = result.stdout + result.stderr
        assert "node" in shown or command == "report"
        bad = sorted({c for c in shown if (ord(c) < 32 and c not in "\n") or 0x7F <= ord(c) <= 0x9F or c == "\u202e"})
        assert not bad, (command, bad, shown)


def test_status_reads_a_failed_jobs_error_from_its_logs_never_its_result_pickles(
    runner, tmp_path, monkeypatch, never_unpickled
):
    """The bug: `status` asked submitit for a failed job's exception, which unpickles each task's
    result file in the output folder (a file anyone who can write there can make); a job record
    naming 10^12 tasks ended in a MemoryError, and tasks with no result waited 15 s each."""
    from runtime.outputs import state_dir

    out, marker = tmp_path / "out", tmp_path / "unpickled"
    state_dir(out).mkdir(parents=True)
    record = [{"submitted_at": "20260101T000000000000", "folder": "sub1", "job_ids": ["123"], "tasks": 3}]
    (state_dir(out) / "jobs.json").write_text(json.dumps(record))
    logs = out / "slurm" / "sub1" / "123"
    logs.mkdir(parents=True)
    for task in range(3):
        (logs / f"123_{task}_result.pkl").write_bytes(pickle.dumps(("error", Trap(marker))))
    # as torch.distributed prints a rank's uncaught exception: each line prefixed with its rank
    (logs / "123_0_log.err").write_text(
        "[rank0]: Traceback (most recent call last):\n[rank0]: slurm.faults.RuntimeError: boom on rank 0\n"
    )
    (logs / "123_1_log.err").write_text("nothing went wrong here\n")
    monkeypatch.setattr("slurm.job_errors.slurm_states", lambda ids: dict.fromkeys(ids, "FAILED"))
    result = runner.invoke(app, ["status", str(out)])
    assert result.exit_code == 1, result.stderr[-2000:]  # a failed job
    assert "RuntimeError: boom on rank 0" in result.stdout.replace("\n", " "), result.stdout
    assert not marker.exists() and not never_unpickled
    record[0]["tasks"] = 10**12
    (state_dir(out) / "jobs.json").write_text(json.dumps(record))
    refused(runner.invoke(app, ["status", str(out)]), "damaged job record", "not an integer from 1 to 65536")


def test_a_lora_in_float8_or_given_twice(runner, tmp_path, saved_model_dir, lora):
    """float8 factors are checked (torch has no isfinite of float8: a traceback); one file twice
    in an item made one adapter at the last scale while the sidecar recorded both."""
    small = tmp_path / "f8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in load_file(str(lora)).items()}, str(small))
    assert check(runner, saved_model_dir, "--prompt", "a", "--lora", str(small)).exit_code == 0
    twice = check(runner, saved_model_dir, "--prompt", "a", "--lora", f"{lora}:0.5", "--lora", f"{lora.parent}:-0.5")
    refused(twice, "are the same LoRA file; give it once, with the sum of the scales")


@pytest.mark.parametrize("case", ["nul prompts", "nul jsonl image", "image loop", "mag_ratios loop"])
def test_paths_no_file_system_takes_are_one_line(runner, tmp_path, case):
    """The bugs: a NUL byte in a run file's or a JSONL line's path (ValueError: embedded null
    byte) and a loop of symbolic links (RuntimeError: Symlink loop) ended in tracebacks."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    batch, run_file = tmp_path / "batch.jsonl", tmp_path / "run.toml"
    batch.write_text(json.dumps({"prompt": "a", "image": "x\u0000.png"}) + "\n")
    run_file.write_text('prompts = "a\\u0000b.txt"\n')
    args = {
        "nul prompts": (["--config", str(run_file)], "a path holds no NUL byte"),
        "nul jsonl image": (["--model", "wan2.1-i2v-14b-480p", "--prompts", str(batch)], "a path holds no NUL byte"),
        "image loop": (
            ["--model", "wan2.1-i2v-14b-480p", "--prompt", "a", "--image", str(tmp_path / "a")],
            "its symbolic links loop",
        ),
        "mag_ratios loop": (["--prompt", "a", "--step-cache", f"magcache:mag_ratios={tmp_path / 'a'}"], "mag_ratios"),
    }
    argv, needle = args[case]
    refused(runner.invoke(app, ["check", "--device", "cpu", *argv]), needle)


@pytest.mark.parametrize("entry", [".ditango", ".ditango/lock", ".ditango/clock", "0000-1e4f9923.mp4"])
def test_links_to_nothing_and_items_of_another_kind_refuse_a_run(runner, tmp_path, entry):
    """The bugs: a lock that links to nothing could be neither made nor taken over (generate
    spun for ever); the clock linking outside the folder was touched there; `.ditango` linking
    to nothing gave a FileExistsError; a folder named like an item's MP4 failed the run after
    the video was made. Refused before anything runs, nothing written."""
    out = tmp_path / "out"
    (out / ".ditango").mkdir(parents=True)
    if entry == ".ditango":
        (out / ".ditango").rmdir()
    outside = tmp_path / "outside"
    if entry.endswith(".mp4"):
        (out / entry).mkdir()
    else:
        (out / entry).symlink_to(outside / "x")
    line = refused(runner.invoke(app, ["generate", "--prompt", "a", "--out", str(out), *FAST_ARGV]))
    assert str(out / entry) in line and ("symbolic link to nothing" in line or "a folder, not a regular file" in line)
    assert not outside.exists() and not list(out.glob("*.json"))


def test_model_weights_under_a_name_no_loader_takes_are_refused(runner, tmp_path, saved_model_dir):
    """A component whose safetensors file has another name than the one diffusers (or
    transformers) loads passed `check`, then failed at load with two lines."""
    model = tmp_path / "model"
    shutil.copytree(saved_model_dir, model)
    (model / "vae" / "diffusion_pytorch_model.safetensors").rename(model / "vae" / "weights.safetensors")
    refused(check(runner, model, "--prompt", "a"), "has weights.safetensors but no diffusion_pytorch_model.safetensors")


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("num_layers", 10**30, "layers must be a positive integer of at most"),
        ("patch_size", [1, 0, 2], "patch[1] must"),
    ],
)
def test_a_model_config_with_a_size_no_model_has_is_one_line(runner, tmp_path, saved_model_dir, key, value, needle):
    """10^30 layers passed `check` and hung `generate`; a patch of 0 was a ZeroDivisionError."""
    model = tmp_path / "model"
    shutil.copytree(saved_model_dir, model)
    config = json.loads((model / "transformer" / "config.json").read_text())
    (model / "transformer" / "config.json").write_text(json.dumps(config | {key: value}))
    refused(check(runner, model, "--prompt", "a"), needle)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ({"prompt": "a", "guidance": 10**400}, '"guidance" must be a number'),
        ({"prompt": "a", "loras": [{"source": "x.safetensors", "scale": 10**400}]}, "scale must be a number within"),
    ],
)
def test_a_number_no_float_holds_is_one_line(runner, tmp_path, line, needle):
    """JSON integers have no bound: 10^400 ended in an OverflowError converting it to a float."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps(line) + "\n")
    refused(runner.invoke(app, ["check", "--device", "cpu", "--prompts", str(batch)]), needle)
