"""`ditango check` refuses what `generate` would (same line, before anything runs), and an
item whose latents become NaN/inf is failed at once instead of being recorded done."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from basics.errors import ConfigError
from ditango_cli.app import app
from runtime.denoiser import Denoiser
from runtime.out_folder import check_writable

FAST = ["--steps", "2", "--height", "16", "--width", "16", "--frames", "1", "--device", "cpu"]
# The saved test model's VAE compresses 8x: 32x32 pixels are 4 tokens, enough for two ranks.
NAN_FAST = ["--steps", "2", "--height", "32", "--width", "32", "--frames", "1", "--device", "cpu", "-q"]


def one_line_error(runner, args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


@pytest.fixture(scope="module")
def wide_patch_model(tmp_path_factory):
    """A user checkpoint whose transformer patches 2 latent frames and 2x4 latent pixels."""
    from diffusers import WanPipeline

    from tiny_wan import TinyWanConfig, build_tiny_wan

    cfg = TinyWanConfig(seed=5, heads=2, head_dim=12, layers=1, ffn_dim=24, text_dim=24, patch_size=(2, 2, 4))
    path = tmp_path_factory.mktemp("models") / "wide-patch"
    WanPipeline(**build_tiny_wan(cfg)).save_pretrained(path, safe_serialization=True)
    return path


PROC_OUT = "/proc/ditango-out"
BAD_INPUTS = [
    # Sizes that passed `check` and failed inside the model (reshape of the rotary table).
    (["--height", "2056", "--width", "16"], "height must be at most 2048", "try 2048"),
    (["--width", "2064", "--height", "16"], "width must be at most 2048", "try 2048"),
    (["--frames", "1025"], "frames must be at most 1021", "try 1021"),
    # Timeouts: nan passes every comparison, inf overflows the process group's timedelta.
    (["--timeout", "nan"], "--timeout must be a finite number of seconds from 1 to 604800 (7 days), got nan", None),
    (["--timeout", "inf"], "--timeout must be a finite number of seconds from 1 to 604800 (7 days), got inf", None),
    (["--setup-timeout", "inf"], "--setup-timeout must be a finite number of seconds from 1 to 604800", "got inf"),
    (["--setup-timeout", "nan"], "--setup-timeout must be a finite number of seconds from 1 to 604800", "got nan"),
    # Careless sizes: a timeout past a timedelta's range, a billion denoising steps.
    (["--timeout", "1e300"], "--timeout must be a finite number of seconds from 1 to 604800", "got 1e+300"),
    (["--steps", "1000000000"], "steps must be in [1, 1000]", "got 1000000000"),
    # More array tasks than items: `generate` refused it, `check` said ok.
    (["--array", "3", "--executor", "local"], "--array 3 is more than the 1 items", None),
    # An empty --out is the current folder; /proc holds no files (os.access says yes to root).
    (["--out", ""], "--out", "is empty"),
    (["--out", PROC_OUT], f"output dir {PROC_OUT} is not writable", "/proc is on proc"),
]


@pytest.mark.parametrize("extra,needle,hint", BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_check_and_generate_refuse_alike(runner, tmp_path, extra, needle, hint):
    """Bug: `check` said ok for these and `generate` failed later (inside the ranks, or on
    every retry of the item); both must refuse them up front with the same one line."""
    if PROC_OUT in extra and not (sys.platform.startswith("linux") and Path("/proc/self").is_dir()):
        pytest.skip("no /proc here")
    args = ["--prompt", "a red circle", "--out", str(tmp_path / "out"), *FAST, *extra]
    checked = one_line_error(runner, ["check", *args])
    assert not (tmp_path / "out").exists()  # check creates nothing
    assert one_line_error(runner, ["generate", *args]) == checked
    assert needle in checked and (hint is None or hint in checked), checked


@pytest.mark.parametrize(
    "size,needle",
    [
        (["--height", "16", "--width", "48", "--frames", "5"], "width must be a positive multiple of 32"),
        (["--height", "16", "--width", "32", "--frames", "9"], "frames must give a multiple of 2 latent frames"),
        (["--height", "16", "--width", "32", "--frames", "2053"], "frames must be at most 2045"),
    ],
)
def test_user_checkpoint_geometry(runner, tmp_path, wide_patch_model, size, needle):
    """Bug: sizes the checkpoint's patch (from its config) cannot take reached the model and
    failed there with a tensor size mismatch; check and generate now refuse them alike."""
    args = [
        "--model",
        str(wide_patch_model),
        "--prompt",
        "a red circle",
        "--out",
        str(tmp_path / "o"),
        "--steps",
        "1",
        "--device",
        "cpu",
        *size,
    ]
    checked = one_line_error(runner, ["check", *args])
    assert checked == one_line_error(runner, ["generate", *args])
    assert needle in checked and "try " in checked, checked


def test_user_checkpoint_valid_geometry_runs(runner, tmp_path, wide_patch_model):
    out = tmp_path / "o"
    args = [
        "generate",
        "--model",
        str(wide_patch_model),
        "--prompt",
        "a red circle",
        "--out",
        str(out),
        "--steps",
        "1",
        "--height",
        "16",
        "--width",
        "32",
        "--frames",
        "5",
        "--device",
        "cpu",
        "-q",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "report.json").read_text())["counts"]["done"] == 1


def test_empty_out_in_a_run_file(runner, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('prompt = "a red circle"\nout = ""\n')
    line = one_line_error(runner, ["check", "--config", str(run_file), *FAST])
    assert "out = ''" in line and "is empty" in line, line


def test_check_writable_probes_without_creating_out(tmp_path):
    """Bug: create=False trusted os.access. Now it writes (and removes) a file in the nearest
    existing folder, and does not create OUT or any folder on the way to it."""
    out = tmp_path / "a" / "b"
    check_writable(out, create=False)
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(Exception, match="is not a directory"):
        check_writable(blocker / "out", create=False)
    with pytest.raises(Exception, match="is not a directory"):
        check_writable(blocker / "out", create=True)


def _nan_model(saved_model_dir: Path, tmp_path: Path, word: str) -> Path:
    """A copy of the saved tiny model whose text embedding of `word` is NaN (safetensors): a
    prompt with that word denoises to NaN latents, the others are untouched."""
    from transformers import AutoTokenizer

    path = tmp_path / "nan-model"
    shutil.copytree(saved_model_dir, path)
    token = AutoTokenizer.from_pretrained(path / "tokenizer").convert_tokens_to_ids(word)
    weights_file = path / "text_encoder" / "model.safetensors"
    weights = load_file(weights_file)
    keys = [k for k in weights if k == "shared.weight" or k.endswith("embed_tokens.weight")]
    assert keys
    for key in keys:
        weights[key][token] = float("nan")
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


def _prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text(
        json.dumps({"id": "fine-a", "prompt": "a red circle"})
        + "\n"
        + json.dumps({"id": "broken", "prompt": "a blue square"})
        + "\n"
        + json.dumps({"id": "fine-b", "prompt": "a green ball"})
        + "\n"
    )
    return prompts


def _assert_nan_item_failed_once(result, out: Path, retries: int) -> None:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "1 item(s) failed: broken" in result.stderr and "NonFiniteLatents" in result.stderr, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["counts"] == {"done": 2, "skipped": 0, "failed": 1}
    by_id = {r["id"]: r for r in report["items"]}
    broken = by_id["broken"]
    assert broken["status"] == "failed" and broken["final"] is True
    assert broken["error"].startswith("NonFiniteLatents: latents have ")
    assert "NaN/inf values after step 2 of 2; first non-finite after step 1" in broken["error"], broken["error"]
    assert broken["attempts"] == 1  # given up at once (final), never run again
    assert json.loads((out / "broken.json").read_text()) == broken
    assert not (out / "broken.mp4").exists()
    for item_id in ("fine-a", "fine-b"):
        assert by_id[item_id]["status"] == "done" and (out / f"{item_id}.mp4").is_file()
    assert "retry" not in result.stderr


def test_nan_weight_fails_the_item_once_and_the_batch_goes_on(runner, tmp_path, saved_model_dir, monkeypatch):
    """Bug: NaN latents (here from a NaN weight of a user checkpoint) were decoded into a
    garbage MP4 and recorded done. Now the item fails with NonFiniteLatents, is not retried
    (deterministic: exactly one attempt), the other items are done and generate exits 1."""
    model = _nan_model(saved_model_dir, tmp_path, "blue")
    runs: list[int] = []
    denoise = Denoiser.denoise

    def counting(self, *args, **kwargs):
        runs.append(1)
        return denoise(self, *args, **kwargs)

    monkeypatch.setattr(Denoiser, "denoise", counting)
    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(model),
        "--prompts",
        str(_prompts(tmp_path)),
        "--out",
        str(out),
        "--retries",
        "2",
        *NAN_FAST,
    ]
    result = runner.invoke(app, args)
    _assert_nan_item_failed_once(result, out, retries=2)
    assert len(runs) == 3  # one denoising per item: the NaN one was not tried again


@pytest.mark.distributed
@pytest.mark.e2e
def test_nan_weight_on_two_ranks_fails_the_item_without_a_relaunch(runner, tmp_path, saved_model_dir):
    """The same on two context-parallel ranks: both see the same NaN latents, record it and go
    on to the next item together; no rank raises, so nothing is relaunched or retried."""
    model = _nan_model(saved_model_dir, tmp_path, "blue")
    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(model),
        "--prompts",
        str(_prompts(tmp_path)),
        "--out",
        str(out),
        "--gpus",
        "2",
        "--parallel",
        "ring",
        "--executor",
        "local",
        "--timeout",
        "120",
        *NAN_FAST,
    ]
    result = runner.invoke(app, args)
    _assert_nan_item_failed_once(result, out, retries=1)
    logs = "".join(p.read_text() for p in (out / "logs").glob("rank-*.log")) if (out / "logs").is_dir() else ""
    assert "Traceback" not in logs


def test_more_local_cpu_ranks_than_memory_holds_are_refused_naming_how_many_fit(runner, tmp_path, monkeypatch):
    """Bug: `--gpus-per-node 100` started 100 local ranks on a 2-core, 24 GiB machine. Each CPU
    rank holds the whole pipeline: the number that fits is the available memory over a rank's."""
    import runtime.memory_plan

    monkeypatch.setattr(runtime.memory_plan, "available_host_memory", lambda: int(2.5 * 2**30))
    base = [
        "check",
        "--prompt",
        "a red circle",
        "--out",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--executor",
        "local",
        "--parallel",
        "ring",  # every rank used (the layout search may leave some idle)
    ]
    line = one_line_error(runner, [*base, "--gpus-per-node", "100"])
    fits = int(re.search(r"enough for (\d+): use at most \1 ranks", line).group(1))
    assert 1 <= fits < 100 and "100 local rank(s) on CPUs need about" in line, line
    assert runner.invoke(app, [*base, "--gpus-per-node", str(fits)]).exit_code == 0
    assert f"enough for {fits}" in one_line_error(runner, [*base, "--gpus-per-node", str(fits + 1)])
    assert f"enough for {fits}" in one_line_error(
        runner, [*base, "--gpus-per-node", "1", "--replicas", "1", "--nodes", str(fits + 1)]
    )
    monkeypatch.setattr(runtime.memory_plan, "available_host_memory", lambda: 2**28)  # not even one
    assert "run on GPUs, or on a machine with more memory" in one_line_error(runner, base)


@pytest.mark.parametrize("version", ["2.4.1", "2.6.0+cu124", "1.13.1"])
def test_a_torch_older_than_the_runtime_needs_is_one_line_before_loading(runner, tmp_path, monkeypatch, version):
    """Bug: pyproject.toml said torch>=2.4 while --shard-weights (fully_shard's ignored_params) and
    --parallel tp (parallelize_module's src_data_rank) need 2.7: an older torch failed inside the
    ranks with a TypeError."""
    import torch

    from runtime.models import loading

    monkeypatch.setattr(torch, "__version__", version)
    for command in ("check", "generate"):
        line = one_line_error(runner, [command, "--prompt", "a red circle", "--out", str(tmp_path / "o"), *FAST])
        assert line == (
            f"error: ditango needs torch >= 2.7, this environment has {version}; install a newer build "
            "(pip install 'torch>=2.7' from your CUDA's index)"
        )
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="needs torch >= 2.7"):  # a rank with an older torch than the launcher
        loading.check_torch()
    monkeypatch.setattr(torch, "__version__", "2.7.0a0+79aa17489c.nv25.04")  # NGC's pre-release: accepted
    loading.check_torch()
