"""What a hostile or careless user gives `generate` and `check`: every case is one `error:`
line and exit 2, before anything is loaded or written (nothing appears outside the output
folder, and the output folder is not created). Each case once gave a traceback, ran with a
value of the wrong type, or failed only inside an item."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ditango_cli.app import app
from runtime.models.registry import BUILTIN_DIR

from .conftest import FAST_ARGV

DEEP = 60_000  # levels of nesting: beyond any parser's recursion limit


def refused(runner, tmp_path, args: list[str], needle: str, commands=("generate", "check")) -> None:
    """`args` under each command: one error line holding `needle`, exit 2, no output folder."""
    out = tmp_path / "out"
    for command in commands:
        extra = [a for a in FAST_ARGV if command == "generate" or a != "--quiet"]
        result = runner.invoke(app, [command, *args, "--out", str(out), *extra])
        assert result.exit_code == 2, (command, result.exit_code, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (command, result.stderr[-2000:])
        assert needle in lines[0], (command, lines[0])
        assert "Traceback" not in result.stderr and not out.exists(), command


@pytest.mark.parametrize("line", ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP])
def test_a_deeply_nested_prompt_line(runner, tmp_path, line):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a cat"}\n' + line + "\n")
    refused(runner, tmp_path, ["--prompts", str(prompts)], "p.jsonl line 2: JSON nested too deeply")


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("run.json", '{"options": ' + "[" * DEEP + "]" * DEEP + "}", "JSON nested too deeply"),
        ("run.toml", "steps = " + "[" * DEEP + "]" * DEEP, "TOML nested too deeply"),
    ],
)
def test_a_deeply_nested_run_file(runner, tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    refused(runner, tmp_path, ["--prompt", "a cat", "--config", str(path)], needle)


def test_a_device_or_an_endless_file_is_never_read_whole(runner, tmp_path):
    refused(runner, tmp_path, ["--prompt", "a cat", "--config", "/dev/zero"], "is a device, not a regular file")
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_DIR, model)
    with open(model / "model_index.json", "r+b") as f:  # sparse: 20 MiB read as zeros
        f.truncate(20 * 2**20)
    refused(runner, tmp_path, ["--prompt", "a cat", "--model", str(model)], "larger than 16 MiB; not read")


def test_a_model_index_that_is_not_utf8(runner, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_DIR, model)
    (model / "model_index.json").write_bytes(b'{"_class_name": "Wan\xffPipeline"}')
    refused(runner, tmp_path, ["--prompt", "a cat", "--model", str(model)], "model_index.json: not UTF-8 text")


def test_a_lone_surrogate_in_a_prompt(runner, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a cat \\ud800 on a mat"}\n')
    refused(runner, tmp_path, ["--prompts", str(prompts)], "p.jsonl line 1: a string holds a lone surrogate (\\ud800)")
    refused(runner, tmp_path, ["--prompt", "a cat \udcff"], "--prompt: a string holds a lone surrogate (\\udcff)")


@pytest.mark.parametrize("flag", ["--gpu-memory", "--cache-memory-limit"])
def test_a_size_of_400_digits(runner, tmp_path, flag):
    args = ["--prompt", "a cat", flag, "9" * 400] + (
        ["--parallel", "ditango"] if flag == "--cache-memory-limit" else []
    )
    refused(runner, tmp_path, args, "larger than any machine's memory")


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("steps = true", "steps = True: expected an integer"),
        ("seed = true", "seed = True: expected an integer"),
        ("steps = 2.5", "steps = 2.5: expected an integer"),
        ("guidance = true", "guidance = True: expected a number"),
        ("prompt = 5", "prompt = 5: expected a string"),
        ("prompt = 1.5", "prompt = 1.5: expected a string"),
        ('prompt = ["a", "b"]', "prompt = ['a', 'b']: expected a string"),
        ('save_latents = "yes"', "save_latents = 'yes': expected true or false"),
    ],
)
def test_a_run_file_value_of_the_wrong_type(runner, tmp_path, toml, needle):
    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    args = ["--config", str(path)] + ([] if toml.startswith("prompt ") else ["--prompt", "a cat"])
    refused(runner, tmp_path, args, needle)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("first-block:threshold=nan", "threshold='nan' is not valid (a finite number)"),
        ("magcache:threshold=inf", "threshold='inf' is not valid (a finite number)"),
        ("magcache:retention_ratio=nan", "retention_ratio='nan' is not valid (a number from 0 to 1)"),
        ("magcache:retention_ratio=2", "retention_ratio='2' is not valid (a number from 0 to 1)"),
        ("pab:spatial_attention_timestep_skip_range=900-100", "is not valid"),
    ],
)
def test_step_cache_values_are_checked_when_parsed(runner, tmp_path, spec, needle):
    refused(runner, tmp_path, ["--prompt", "a cat", "--step-cache", spec], needle)


@pytest.mark.parametrize("ratios", ["[1.0, NaN, 0.9]", "[1.0, Infinity]", "[1.0, -2.0]", "[true, 1.0]"])
def test_magcache_ratios_must_be_finite_positive_numbers(runner, tmp_path, ratios):
    path = tmp_path / "ratios.json"
    path.write_text(ratios)
    needle = "is not a JSON list of finite positive numbers"
    refused(runner, tmp_path, ["--prompt", "a cat", "--step-cache", f"magcache:mag_ratios={path}"], needle)


def test_a_truncated_image_is_refused_by_check_as_by_generate(runner, tmp_path):
    from PIL import Image

    whole = tmp_path / "whole.jpg"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(whole, quality=95)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat", "image": str(cut)}) + "\n")
    model = tmp_path / "i2v"
    _save_i2v(model)
    refused(runner, tmp_path, ["--prompts", str(prompts), "--model", str(model)], "cannot be read as an image")


def _save_i2v(path) -> None:
    from diffusers import WanImageToVideoPipeline

    from tiny_wan import TinyWanConfig, build_tiny_wan
    from tiny_wan.build import pipeline_kwargs

    cfg = TinyWanConfig(image="clip", heads=4, head_dim=8, layers=1, ffn_dim=32, text_dim=24, text_heads=2)
    WanImageToVideoPipeline(**build_tiny_wan(cfg), **pipeline_kwargs(cfg)).save_pretrained(
        path, safe_serialization=True
    )


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            ("model_index.json", "text_encoder", ["transformers", "NoSuchEncoderModel"]),
            "text_encoder is a transformers.NoSuchEncoderModel, which transformers",
        ),
        (("model_index.json", "text_encoder", ["os", "system"]), "text_encoder comes from 'os'"),
        (
            ("transformer/config.json", "num_attention_heads", 0),
            "heads must be a positive integer of at most 4096, got 0",
        ),
        (("transformer/config.json", "attention_head_dim", "x"), "transformer/config.json: a value is not what"),
    ],
)
def test_a_model_folder_that_cannot_load_is_refused_by_check(runner, tmp_path, edit, needle):
    """Classes the installed libraries lack, classes from elsewhere, sizes that are no sizes:
    said before loading (by `check` too), never a traceback from inside diffusers."""
    file, key, value = edit
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_DIR, model)
    data = json.loads((model / file).read_text())
    data[key] = value
    (model / file).write_text(json.dumps(data))
    refused(runner, tmp_path, ["--prompt", "a cat", "--model", str(model)], needle)


def test_nothing_is_written_outside_out(runner, tmp_path, monkeypatch):
    """A refused run leaves the working folder as it found it."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    path = tmp_path / "run.toml"
    path.write_text("steps = true\n")
    result = runner.invoke(app, ["generate", "--prompt", "a", "--config", str(path), *FAST_ARGV])
    assert result.exit_code == 2
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "run.toml"])


def test_bookkeeping_files_that_are_not_files_never_hang_a_command(tmp_path):
    """A FIFO where the folder's lock or a heartbeat should be: reading it would wait for a
    writer forever. `status` reads the lock as damaged and skips the heartbeat."""
    import subprocess
    import sys
    from pathlib import Path

    from runtime.outputs import state_dir

    out = tmp_path / "out"
    (state_dir(out) / "progress").mkdir(parents=True)
    os.mkfifo(state_dir(out) / "lock")
    os.mkfifo(state_dir(out) / "progress" / "report.json")
    ditango = Path(sys.executable).parent / "ditango"
    shown = subprocess.run([str(ditango), "status", str(out)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "items in" in shown.stdout and "progress:" not in shown.stdout
