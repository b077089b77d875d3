"""Models where users keep them: Hugging Face repo ids, the HF cache's layout (refs, snapshots
of symlinks into blobs), `ditango download`, and ranks that never download.

The cache is built from the built-in model under a temporary HF_HOME, laid out as
huggingface_hub lays it out: models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> ->
../../blobs/<sha256>, refs/main}."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from basics.errors import ConfigError
from ditango_cli.app import app
from runtime.errors import ModelDirError
from runtime.models import hub
from runtime.models.registry import BUILTIN_DIR
from runtime.models.resolve import resolve_model

from .conftest import FAST_ARGV

REPO = "tiny-org/tiny-wan-diffusers"  # not in the registry: resolves as a user directory
REV_A, REV_B = "a" * 40, "b" * 39 + "1"


def add_snapshot(cache: Path, repo_id: str, commit: str, source: Path = BUILTIN_DIR, refs: tuple[str, ...] = ()):
    """`source`'s files as snapshot `commit` of `repo_id` in `cache`: bytes in blobs/, named by
    their hash, and symlinks to them under snapshots/<commit>/; `refs` point at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = repo / "snapshots" / commit / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache under a temporary HF_HOME (the user's own, and model roots, unset)."""
    for name in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "DITANGO_MODEL_ROOT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_repo_id_resolves_to_its_snapshot_of_symlinks(cache):
    snapshot = add_snapshot(cache, REPO, REV_A, refs=("main",))
    resolved = resolve_model(REPO)
    assert resolved.path == snapshot and resolved.path.is_absolute()
    weights = resolved.path / "transformer" / "diffusion_pytorch_model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent.name == "blobs"
    assert (resolved.spec.layers, resolved.spec.heads, resolved.spec.family) == (4, 4, "wan")


def test_revisions_pick_a_snapshot(cache):
    """refs/main names one snapshot, `@REV` / `revision=` (a commit, a unique commit prefix, a
    named ref) another; a hand-written ref that ends in a newline works too."""
    first = add_snapshot(cache, REPO, REV_A, refs=("main",))
    second = add_snapshot(cache, REPO, REV_B, refs=("v2",))
    (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "v2").write_text(REV_B + "\n")
    assert resolve_model(REPO).path == first
    assert resolve_model(f"{REPO}@{REV_B}").path == second
    assert resolve_model(REPO, revision=REV_B).path == second
    assert resolve_model(f"{REPO}@{REV_B[:8]}").path == second
    assert resolve_model(f"{REPO}@v2").path == second
    assert resolve_model(f"{REPO}@main").path == first
    with pytest.raises(ConfigError, match="two revisions"):
        resolve_model(f"{REPO}@{REV_A}", revision=REV_B)
    with pytest.raises(ModelDirError, match=f"{REPO}' at revision nope is not in"):
        resolve_model(f"{REPO}@nope")


def test_the_cache_repo_folder_is_its_main_snapshot(cache):
    """The bug: a path to models--ORG--NAME was refused as an incomplete model directory."""
    first = add_snapshot(cache, REPO, REV_A, refs=("main",))
    second = add_snapshot(cache, REPO, REV_B)
    folder = first.parent.parent
    assert resolve_model(str(folder)).path == first
    assert resolve_model(str(folder), revision=REV_B).path == second
    with pytest.raises(ModelDirError, match="holds no snapshot at revision nope"):
        resolve_model(str(folder), revision="nope")


def test_model_root_comes_before_the_cache(cache, tmp_path):
    add_snapshot(cache, REPO, REV_A, refs=("main",))
    root = tmp_path / "root"
    shutil.copytree(BUILTIN_DIR, root / REPO)  # ROOT/ORG/NAME
    assert resolve_model(REPO, root).path == root / REPO
    assert resolve_model(REPO, revision=REV_A, root=root).path.name == REV_A  # a plain folder has no revision
    shutil.rmtree(root / "tiny-org")
    shutil.copytree(BUILTIN_DIR, root / "tiny-wan-diffusers")  # ROOT/NAME
    assert resolve_model(REPO, root).path == root / "tiny-wan-diffusers"


def test_a_registry_repo_in_the_cache_is_checked_against_its_entry(cache, runner):
    """A repo id of the registry's is that entry (--model wan2.1-1.3b and --model
    Wan-AI/Wan2.1-T2V-1.3B-Diffusers alike): found in the cache, then refused when it is not
    that checkpoint (here the tiny model stands in for it)."""
    snapshot = add_snapshot(cache, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", REV_A, refs=("main",))
    for model in ("wan2.1-1.3b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        with pytest.raises(ModelDirError, match=f"{snapshot} is not that checkpoint \\(layers 4 where"):
            resolve_model(model)
    rows = {r["name"]: r for r in json.loads(runner.invoke(app, ["models", "--json"]).stdout)}
    assert rows["wan2.1-1.3b"]["resolves_to"] == f"HF cache {snapshot}"
    assert rows["wan2.1-14b"]["resolves_to"] == "not found: ditango download wan2.1-14b"
    assert rows["wan2.1-14b"]["repo_id"] == "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    assert rows["hunyuanvideo"]["repo_id"] == "hunyuanvideo-community/HunyuanVideo"
    assert rows["tiny-wan"]["repo_id"] is None and rows["tiny-wan"]["resolves_to"] == "built-in"


def test_a_missing_model_names_its_repo_and_the_command_that_fetches_it(cache, runner, tmp_path):
    line = one_error_line(
        runner.invoke(
            app,
            ["check", "--model", "wan2.1-14b", "--prompt", "a cat", "--device", "cpu", "--out", str(tmp_path / "out")],
        )
    )
    assert line == (
        f"error: model 'wan2.1-14b' (Wan-AI/Wan2.1-T2V-14B-Diffusers) is not in the Hugging Face cache ({cache}) "
        "and no --model-root or DITANGO_MODEL_ROOT is set; fetch it with: ditango download wan2.1-14b  "
        "(or: hf download Wan-AI/Wan2.1-T2V-14B-Diffusers), or pass --download"
    )
    same = runner.invoke(
        app,
        [
            "check",
            "--model",
            "Wan-AI/Wan2.1-T2V-14B-Diffusers",
            "--prompt",
            "a cat",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert one_error_line(same) == line  # the registry's repo id is its entry
    args = ["check", "--model", f"{REPO}@{REV_B}", "--prompt", "a", "--model-root", str(tmp_path), "--out", "o"]
    line = one_error_line(runner.invoke(app, args))
    assert f"'{REPO}' at revision {REV_B} is not in --model-root {tmp_path} or the Hugging Face cache" in line
    assert f"ditango download {REPO} --revision {REV_B}" in line


def test_the_rank_side_never_downloads(cache, tmp_path, monkeypatch):
    """What a rank does (resolve the snapshot path the submitting host put in the RunConfig, load
    it, generate) with every huggingface_hub download function raising, wherever it was imported."""
    import diffusers
    import huggingface_hub

    from runtime.config import Item, RunConfig
    from runtime.run import execute

    snapshot = add_snapshot(cache, REPO, REV_A, refs=("main",))
    originals = {huggingface_hub.snapshot_download, huggingface_hub.hf_hub_download}
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a download was attempted")

    patched = 0
    for module in list(sys.modules.values()):
        for attr in ("snapshot_download", "hf_hub_download"):
            if getattr(module, attr, None) in originals:
                monkeypatch.setattr(module, attr, refuse)
                patched += 1
    assert patched >= 3  # huggingface_hub's own and the copies diffusers/transformers imported
    offline_during_load = []
    pipeline = diffusers.WanPipeline.from_pretrained.__func__
    monkeypatch.setattr(
        diffusers.WanPipeline,
        "from_pretrained",
        classmethod(
            lambda cls, *a, **k: (
                offline_during_load.append(huggingface_hub.constants.HF_HUB_OFFLINE) or pipeline(cls, *a, **k)
            )
        ),
    )
    assert resolve_model(REPO).path == snapshot  # the cache lookup reads the disk only
    item = Item("x", "a red ball", "", 0, 32, 32, 5, 2, 2.5)
    cfg = RunConfig(REPO, snapshot, (item,), tmp_path / "out", device="cpu", max_text_len=32)
    report = execute(cfg)
    assert calls == [] and report["counts"]["done"] == 1, report
    assert offline_during_load == [True]
    assert (tmp_path / "out" / "x.mp4").stat().st_size > 0
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ  # restored


def test_hub_offline_sets_and_restores(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with hub.hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    assert os.environ["HF_HUB_OFFLINE"] == "0" and constants.HF_HUB_OFFLINE is False


@pytest.fixture
def fake_hub(cache, monkeypatch):
    """huggingface_hub.snapshot_download replaced by one that lays out `fake_hub.source` as
    snapshot REV_A in the cache it is given (honouring allow_patterns), recording its calls."""
    import huggingface_hub

    class Fake:
        source = BUILTIN_DIR
        calls: list[dict] = []

        def __call__(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **kwargs):
            self.calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": allow_patterns, **kwargs})
            staged = Path(cache_dir).parent / "staged"
            shutil.rmtree(staged, ignore_errors=True)
            for file in (p for p in self.source.rglob("*") if p.is_file()):
                rel = str(file.relative_to(self.source))
                if any(fnmatch.fnmatch(rel, pat) for pat in allow_patterns):
                    (staged / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(file, staged / rel)
            return str(add_snapshot(Path(cache_dir), repo_id, revision or REV_A, staged, refs=("main",)))

    fake = Fake()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


def test_download_fetches_safetensors_into_the_cache_and_prints_the_snapshot(fake_hub, cache, runner, tmp_path):
    result = runner.invoke(app, ["download", REPO])
    assert result.exit_code == 0, result.stderr
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REV_A
    assert result.stdout.strip() == str(snapshot)
    call = fake_hub.calls[0]
    assert (call["repo_id"], call["revision"]) == (REPO, None)
    assert "*.safetensors" in call["allow_patterns"] and "*.json" in call["allow_patterns"]
    for pickle in ("diffusion_pytorch_model.bin", "model.pt", "model.pth", "model.ckpt"):
        assert not any(fnmatch.fnmatch(pickle, pat) for pat in call["allow_patterns"]), pickle
    ok = runner.invoke(
        app, ["check", "--model", REPO, "--prompt", "a", "--device", "cpu", "--json", "--out", str(tmp_path / "out")]
    )
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["model_path"] == str(snapshot) and len(fake_hub.calls) == 1  # found, not fetched


def test_download_flag_fetches_only_what_is_missing(fake_hub, cache, runner, tmp_path):
    args = [
        "generate",
        "--model",
        f"{REPO}@{REV_B}",
        "--prompt",
        "a",
        "--out",
        str(tmp_path / "out"),
        *FAST_ARGV,
        "--download",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert [c["revision"] for c in fake_hub.calls] == [REV_B]
    shown = runner.invoke(app, ["check", *(a for a in args[1:-1] if a != "--quiet"), "--json"])  # in the cache now
    assert shown.exit_code == 0 and Path(json.loads(shown.stdout)["model_path"]).name == REV_B
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0 and len(fake_hub.calls) == 1


def test_download_refuses_offline_and_pickle_only_repos(fake_hub, cache, runner, tmp_path, monkeypatch):
    pickles = tmp_path / "pickles"
    shutil.copytree(BUILTIN_DIR, pickles, ignore=shutil.ignore_patterns("*.safetensors"))
    (pickles / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    fake_hub.source = pickles
    line = one_error_line(runner.invoke(app, ["download", "some-org/pickled"]))
    assert "some-org/pickled has no .safetensors weights" in line and "pickle" in line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = one_error_line(runner.invoke(app, ["download", "wan2.1-14b"]))
    assert "cannot download Wan-AI/Wan2.1-T2V-14B-Diffusers: HF_HUB_OFFLINE is set" in line
    args = ["generate", "--model", REPO, "--prompt", "a", "--out", str(tmp_path / "o"), *FAST_ARGV, "--download"]
    assert "HF_HUB_OFFLINE is set" in one_error_line(runner.invoke(app, args))
    assert len(fake_hub.calls) == 1  # the pickle repo's only
    built_in = runner.invoke(app, ["download", "tiny-wan"])
    assert built_in.exit_code == 0 and "built in" in built_in.stderr


@pytest.mark.e2e
def test_generate_from_the_cache_offline_in_a_subprocess(cache, tmp_path):
    """`ditango generate --model ORG/NAME` with HF_HUB_OFFLINE=1: the whole command, as a user
    runs it on a compute node, from a cache of symlinked blobs."""
    add_snapshot(cache, REPO, REV_A, refs=("main",))
    env = {**os.environ, "HF_HOME": str(cache.parent), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "out"
    argv = [
        "generate",
        "--model",
        REPO,
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--device",
        "cpu",
        "--quiet",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "ditango_cli.app", *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["counts"]["done"] == 1 and report["model"] == REPO
    assert (out / f"{report['items'][0]['id']}.mp4").stat().st_size > 0


def test_a_dry_run_never_downloads(fake_hub, cache, runner, tmp_path):
    """--dry-run writes nothing, a download included: a named model not here yet is a note."""
    args = [
        "generate",
        "--model",
        "wan2.1-1.3b",
        "--prompt",
        "a",
        "--device",
        "cpu",
        "--executor",
        "local",
        "--out",
        str(tmp_path / "out"),
        "--dry-run",
        "--json",
        "--download",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert "the run would download it first" in result.stderr
    assert fake_hub.calls == [] and not (tmp_path / "out").exists()


def test_a_dry_run_of_a_repo_not_here_says_how_to_fetch_it(fake_hub, cache, runner, tmp_path):
    """A repo id (no registry entry: its plan needs its config) with --download: the dry run
    cannot show a plan without the download it never makes, and says so in one line."""
    args = [
        "generate",
        "--model",
        "someone/not-here-T2V",
        "--prompt",
        "a",
        "--device",
        "cpu",
        "--executor",
        "local",
        "--out",
        str(tmp_path / "out"),
        "--dry-run",
        "--download",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "the run would download it first" in line and "ditango download someone/not-here-T2V" in line
    assert "pass --download" not in line and fake_hub.calls == []


def test_check_never_downloads(fake_hub, cache, runner, tmp_path):
    """`check` validates a would-be generate: with --download and the model not here, it says
    that generate would fetch it, and fetches nothing."""
    args = [
        "check",
        "--model",
        "wan2.1-1.3b",
        "--prompt",
        "a",
        "--device",
        "cpu",
        "--executor",
        "local",
        "--out",
        str(tmp_path / "out"),
        "--download",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "generate --download would download it first" in line and "ditango download wan2.1-1.3b" in line
    assert fake_hub.calls == []


@pytest.mark.parametrize(
    ("ref", "needle"),
    [
        (b"\xff\xfe not text", "refs/main: not UTF-8 text"),
        (b"../../../../etc\n", "holds no commit hash ('../../../../etc')"),
        (None, "is a FIFO (named pipe), not a regular file"),
        ("folder", "is a folder, not a regular file"),
        ("dangling", "is a symbolic link to nothing"),
    ],
)
def test_a_damaged_ref_in_the_cache_is_one_line(cache, runner, tmp_path, ref, needle):
    """The bug: a refs/main that was not UTF-8 ended generate and check in a UnicodeDecodeError.
    A ref is a commit hash: one that names a path (snapshots/../..) is refused too, and a FIFO
    there is never read (the read would wait for a writer for ever)."""
    import threading

    snapshot = add_snapshot(cache, REPO, REV_A, refs=("main",))
    main = snapshot.parent.parent / "refs" / "main"
    main.unlink()
    if ref is None:
        os.mkfifo(main)
    elif ref == "folder":  # once taken for no ref: the only snapshot was used without a word
        main.mkdir()
    elif ref == "dangling":
        main.symlink_to(tmp_path / "gone")
    else:
        main.write_bytes(ref)
    said = []
    args = ["check", "--model", REPO, "--prompt", "a", "--device", "cpu"]
    worker = threading.Thread(target=lambda: said.append(runner.invoke(app, args)), daemon=True)
    worker.start()
    worker.join(60)
    if not said:  # unblock a reader of the FIFO before failing
        os.close(os.open(main, os.O_WRONLY | os.O_NONBLOCK))
    assert said, "the ref was read"
    assert needle in one_error_line(said[0])
