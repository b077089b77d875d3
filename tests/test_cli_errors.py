"""Every predictable mistake: one `error:` line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from ditango_cli.app import app


def run_error(runner, args, *needles):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def out(tmp_path):
    return str(tmp_path / "out")


def gen(out, *extra):
    return ["generate", "--prompt", "a red circle", "--out", out, "--device", "cpu", *extra]


def test_unknown_model(runner, out):
    run_error(runner, gen(out, "--model", "wan9-huge"), "unknown model 'wan9-huge'", "tiny-wan")


def test_named_model_without_root(runner, out, tmp_path, monkeypatch):
    monkeypatch.delenv("DITANGO_MODEL_ROOT", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    run_error(
        runner,
        gen(out, "--model", "wan2.1-14b"),
        "--model-root",
        "DITANGO_MODEL_ROOT",
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "ditango download wan2.1-14b",
    )


def test_named_model_missing_under_root(runner, out, tmp_path, monkeypatch):
    monkeypatch.setenv("DITANGO_MODEL_ROOT", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    run_error(runner, gen(out, "--model", "wan2.1-1.3b"), f"is not in --model-root {tmp_path}", "ditango download")


def test_model_dir_without_index(runner, out, tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    run_error(runner, gen(out, "--model", str(empty)), "model_index.json is missing")


def test_partial_model_dir_missing_component(runner, out, tmp_path, saved_model_dir):
    partial = tmp_path / "partial"
    shutil.copytree(saved_model_dir, partial)
    shutil.rmtree(partial / "vae")
    run_error(runner, gen(out, "--model", str(partial)), "incomplete", "vae")


def test_partial_model_dir_missing_weights(runner, out, tmp_path, saved_model_dir):
    partial = tmp_path / "partial"
    shutil.copytree(saved_model_dir, partial)
    (partial / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    run_error(runner, gen(out, "--model", str(partial)), "no .safetensors weights", "transformer")


def test_pickle_weights_refused(runner, out, tmp_path, saved_model_dir):
    pickled = tmp_path / "pickled"
    shutil.copytree(saved_model_dir, pickled)
    weights = pickled / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))
    run_error(runner, gen(out, "--model", str(pickled)), "refusing to load pickle weights", ".bin", "safetensors")


def test_unsupported_pipeline_class(runner, out, tmp_path, saved_model_dir):
    other = tmp_path / "other"
    shutil.copytree(saved_model_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionPipeline"
    (other / "model_index.json").write_text(json.dumps(index))
    run_error(runner, gen(out, "--model", str(other)), "StableDiffusionPipeline", "WanPipeline")


EXPERT = ["diffusers", "WanTransformer3DModel"]


@pytest.mark.parametrize(
    "change,needles",
    [
        ({"transformer_2": EXPERT}, ["second expert (transformer_2) but no boundary_ratio"]),
        ({"boundary_ratio": 0.9}, ["boundary_ratio 0.9 but no second expert"]),
        ({"transformer_2": EXPERT, "boundary_ratio": 1.5}, ["boundary_ratio must be a number in (0, 1)"]),
        ({"expand_timesteps": "yes"}, ["expand_timesteps must be true or false"]),
        ({"image_encoder": ["transformers", "CLIPVisionModel"]}, ["WanPipeline with an image encoder"]),
        ({"transformer": ["diffusers", "SkyReelsV2Transformer3DModel"]}, ["SkyReelsV2Transformer3DModel"]),
        ({"controlnet": ["diffusers", "WanTransformer3DModel"]}, ["controlnet", "does not run"]),
    ],
    ids=[
        "expert-without-ratio",
        "ratio-without-expert",
        "bad-ratio",
        "bad-expand",
        "image-encoder-t2v",
        "other-transformer",
        "unknown-component",
    ],
)
def test_a_wan_directory_asking_for_what_is_not_run_is_refused_by_name(
    runner, out, tmp_path, saved_model_dir, change, needles
):
    """What the runtime cannot honour (a second expert diffusers would not run, an image encoder
    a WanPipeline ignores, other classes) would give a wrong video without a word, so `check`
    and `generate` refuse it by name."""
    other = tmp_path / "wan22"
    shutil.copytree(saved_model_dir, other)
    for name, value in change.items():
        if isinstance(value, list) and not (other / name).exists():  # a component folder for it
            shutil.copytree(other / "transformer", other / name)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, **change}))
    for command in ("check", "generate"):
        args = gen(out, "--model", str(other))
        run_error(runner, [command, *args[1:]], *needles)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.mp4"))


def test_experts_of_different_shapes_are_refused(runner, out, tmp_path, saved_model_dir):
    other = tmp_path / "experts"
    shutil.copytree(saved_model_dir, other)
    shutil.copytree(other / "transformer", other / "transformer_2")
    config = json.loads((other / "transformer_2" / "config.json").read_text())
    (other / "transformer_2" / "config.json").write_text(json.dumps({**config, "num_layers": config["num_layers"] + 1}))
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "transformer_2": EXPERT, "boundary_ratio": 0.875}))
    run_error(runner, gen(out, "--model", str(other)), "transformer and transformer_2 differ in num_layers")


def test_a_named_model_must_be_that_checkpoint(runner, out, tmp_path, saved_model_dir):
    """wan2.2-t2v-a14b pointing at a one-expert directory is refused, not run as one expert."""
    root = tmp_path / "root"
    shutil.copytree(saved_model_dir, root / "Wan2.2-T2V-A14B-Diffusers")
    run_error(
        runner,
        gen(out, "--model", "wan2.2-t2v-a14b", "--model-root", str(root)),
        "is not that checkpoint",
        "experts 1 where wan2.2-t2v-a14b has 2",
    )


def test_image_and_second_scale_for_a_text_to_video_model_are_refused(runner, out, tmp_path):
    image = tmp_path / "frame.png"
    Image.new("RGB", (16, 16)).save(image)
    run_error(runner, gen(out, "--image", str(image)), "text-to-video and takes no image")
    run_error(runner, gen(out, "--guidance-2", "3"), "apply to two-expert models")


@pytest.mark.parametrize("frames,hint", [("20", "try 21"), ("0", "try 1")])
def test_frames_not_4k_plus_1(runner, out, frames, hint):
    run_error(runner, gen(out, "--frames", frames), "frames must be 4k+1", hint)


@pytest.mark.parametrize("flag,value,hint", [("--height", "66", "try 64 or 72"), ("--width", "2", "try 8")])
def test_size_not_a_multiple_of_the_builtin_geometry(runner, out, flag, value, hint):
    """tiny-wan: VAE 4x, patch 2x -> multiples of 8."""
    run_error(runner, gen(out, flag, value), f"{flag[2:]} must be a positive multiple of 8", f"got {value}", hint)


def test_size_not_a_multiple_of_a_wan21_geometry(runner, out, saved_model_dir):
    """A Wan2.1-shaped directory: VAE 8x, patch 2x -> multiples of 16."""
    args = gen(out, "--model", str(saved_model_dir), "--width", "40")
    run_error(runner, args, "width must be a positive multiple of 16 (VAE 8x times patch 2x)", "try 32 or 48")


def test_steps_below_one(runner, out):
    run_error(runner, gen(out, "--steps", "0"), "steps must be in [1, 1000]")


def test_negative_guidance(runner, out):
    run_error(runner, gen(out, "--guidance", "-1"), "guidance must be a finite number >= 0")


def test_prompt_and_prompts_together(runner, out, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a red circle\n")
    run_error(runner, gen(out, "--prompts", str(f)), "either --prompt or --prompts")


def test_no_prompt(runner, out):
    run_error(runner, ["generate", "--out", out], "give --prompt TEXT or --prompts FILE")


def test_empty_prompt_file(runner, out, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("# only a comment\n\n   \n")
    run_error(runner, ["generate", "--prompts", str(f), "--out", out], "no prompts")


def test_missing_prompt_file(runner, out, tmp_path):
    run_error(runner, ["generate", "--prompts", str(tmp_path / "nope.jsonl"), "--out", out], "file not found")


def test_wrong_prompt_file_type(runner, out, tmp_path):
    f = tmp_path / "prompts.csv"
    f.write_text("a,b\n")
    run_error(runner, ["generate", "--prompts", str(f), "--out", out], ".txt or .jsonl")


def test_malformed_jsonl_reports_line_number(runner, out, tmp_path):
    f = tmp_path / "batch.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": "broken"\n')
    run_error(runner, ["generate", "--prompts", str(f), "--out", out], "batch.jsonl line 3", "not valid JSON")


def test_unknown_jsonl_key(runner, out, tmp_path):
    f = tmp_path / "batch.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "x", "speed": 8}\n')
    run_error(runner, ["generate", "--prompts", str(f), "--out", out], "line 2", "unknown key(s) speed")


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"seed": 1}', '"prompt" is required'),
        ('{"prompt": "x", "steps": "10"}', '"steps" must be an integer'),
        ('{"prompt": "x", "guidance": true}', '"guidance" must be a number'),
        ('["prompt"]', "expected a JSON object"),
        ('{"prompt": "   "}', "prompt is empty"),
        ('{"prompt": "x", "frames": 10}', "frames must be 4k+1"),
        ('{"prompt": "x", "id": "../escape"}', "not a usable file name"),
        ('{"prompt": "x", "id": "report"}', "reserved: its files would collide with report.json"),
    ],
)
def test_invalid_jsonl_item(runner, out, tmp_path, line, needle):
    f = tmp_path / "batch.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    run_error(runner, ["generate", "--prompts", str(f), "--out", out], "batch.jsonl line 2", needle)


def test_duplicate_ids(runner, out, tmp_path):
    f = tmp_path / "batch.jsonl"
    f.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    run_error(runner, ["generate", "--prompts", str(f), "--out", out], "duplicate id 'x'", "line 1")


def test_output_dir_not_writable(runner, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run_error(runner, gen(str(blocker / "out")), "output dir", "is not writable")


def test_check_reports_unwritable_output(runner, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    run_error(runner, ["check", "--prompt", "x", "--out", str(blocker / "o")], "is not writable")


def test_bad_choice_is_one_line(runner, out):
    run_error(runner, gen(out, "--dtype", "float8"), "float8")


def test_cuda_requested_without_gpu(runner, out):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cpu_build = not (torch.version.cuda or torch.version.hip)
    said = ("CPU-only build", "setup.sh --cuda") if cpu_build else ("no CUDA device",)
    run_error(runner, [*gen(out)[:-2], "--device", "cuda"], "--device cuda", *said)


def test_existing_output_is_skipped_not_overwritten(runner, tmp_path):
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a red circle",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
    ]
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, args)
    assert result.exit_code == 0
    assert "skipping" in result.stderr and "use --overwrite" in result.stderr


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--gpus", "2", "--parallel", "none"], ["2 ranks need a context-parallel strategy"]),
        (["--gpus", "3", "--parallel", "ulysses"], ["Ulysses degree 3", "4 attention heads", "use --parallel ring"]),
        (["--gpus", "8", "--parallel", "ulysses"], ["Ulysses degree 8", "--parallel usp --ulysses-degree 4"]),
        (["--gpus", "4", "--parallel", "usp", "--ulysses-degree", "3"], ["must divide the cp degree 4", "1, 2, 4"]),
        (["--gpus", "2", "--parallel", "ring", "--ulysses-degree", "2"], ["only applies to --parallel usp"]),
        (["--gpus", "0"], ["must be >= 1"]),
        (["--gpus", "2", "--timeout", "0"], ["--timeout must be a finite number of seconds from 1"]),
        (["--gpus", "2", "--timeout", "1e-9"], ["--timeout must be a finite number of seconds from 1", "1e-09"]),
        (
            ["--gpus", "2", "--parallel", "ring", "--height", "8", "--width", "8", "--frames", "1"],
            ["1 tokens cannot be split over 2 ranks"],
        ),
        (["--parallel", "ring", "--attention-backend", "flash"], ["--attention flash needs CUDA", "use sdpa"]),
        (["--attention", "flash3"], ["--attention flash3 needs CUDA; use sdpa (or auto) on CPU"]),
        (["--attention", "reference"], ["--attention reference is for a parallel strategy", "use sdpa, flash"]),
        (["--attention", "fast"], ["fast"]),
        (["--parallel", "spiral"], ["spiral"]),
    ],
)
def test_illegal_layouts(runner, out, extra, needles):
    run_error(runner, gen(out, *extra), *needles)


def test_infinite_guidance(runner, out):
    run_error(runner, gen(out, "--guidance", "inf"), "guidance must be a finite number")


def test_missing_shard_of_sharded_checkpoint(runner, out, tmp_path, saved_model_dir):
    """Real Wan checkpoints are sharded: a partly copied one must be refused before loading."""
    from diffusers import WanTransformer3DModel

    sharded = tmp_path / "sharded"
    shutil.copytree(saved_model_dir, sharded)
    shutil.rmtree(sharded / "transformer")
    WanTransformer3DModel.from_pretrained(saved_model_dir / "transformer").save_pretrained(
        sharded / "transformer", max_shard_size="20KB", safe_serialization=True
    )
    shards = sorted((sharded / "transformer").glob("*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    run_error(runner, gen(out, "--model", str(sharded)), "incomplete", f"missing shard {shards[1].name}")


def test_unloadable_component_is_one_line(runner, out, tmp_path, saved_model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(saved_model_dir, broken)
    config = json.loads((broken / "transformer" / "config.json").read_text())
    config["num_layers"] += 5  # weights no longer match the architecture
    (broken / "transformer" / "config.json").write_text(json.dumps(config))
    run_error(runner, gen(out, "--model", str(broken), "--steps", "1"), "cannot load the model from", str(broken))


def test_existing_output_with_other_settings_is_refused(runner, tmp_path):
    out = tmp_path / "out"
    base = [
        "generate",
        "--prompt",
        "a red circle",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
    ]
    assert runner.invoke(app, [*base, "--steps", "1"]).exit_code == 0
    run_error(runner, [*base, "--steps", "2"], "was made with steps 1, not 2", "--overwrite")
    # Same settings but latents now asked for: regenerated, not skipped.
    result = runner.invoke(app, [*base, "--steps", "1", "--save-latents"])
    assert result.exit_code == 0 and "skipping" not in result.stderr
    assert len(list(out.glob("*.latents.safetensors"))) == 1


def test_byte_order_mark_in_prompt_files(tmp_path):
    from runtime.items import Overrides, build_items
    from runtime.models.registry import REGISTRY

    for name, body in (("p.txt", "a red circle\n"), ("p.jsonl", '{"prompt": "a red circle"}\n')):
        f = tmp_path / name
        f.write_bytes("\ufeff".encode() + body.encode())
        (item,) = build_items(None, f, Overrides(), REGISTRY["tiny-wan"].defaults)
        assert item.prompt == "a red circle"


@pytest.mark.parametrize(
    "extra,needles",
    [
        (
            ["--gpus", "2", "--parallel", "ring", "--cache-ratio", "0.3"],
            ["--cache-ratio only applies to --parallel ditango"],
        ),
        (["--gpus", "4", "--parallel", "ditango", "--group-size", "3"], ["--group-size 3 must divide the cp degree 4"]),
        (["--gpus", "4", "--parallel", "ditango", "--group-size", "two"], ["--group-size must be a number"]),
        (["--gpus", "4", "--parallel", "ditango", "--cache-ratio", "1.5"], ["cache_ratio", "1.5"]),
        (
            ["--gpus", "4", "--parallel", "ditango", "--cache-dtype", "int8"],
            ["--cache-dtype must be float32 or bfloat16"],
        ),
        (["--gpus", "4", "--parallel", "ditango", "--cache-memory-limit", "lots"], ["expected a size like 80GiB"]),
        (["--gpus", "4", "--parallel", "ditango", "--reference", "approx"], ["--reference must be 'exact'"]),
        (["--gpus", "4", "--parallel", "ditango", "--tau-max", "0"], ["tau_max"]),
        (["--gpus", "4", "--parallel", "ditango", "--planner", "greedy"], ["planner='greedy'", "hpdc or budget"]),
        (["--gpus", "4", "--parallel", "ditango", "--own-group", "never"], ["own_group='never'", "decide or fresh"]),
        (["--gpus", "4", "--parallel", "ditango", "--target-psnr", "-3"], ["--target-psnr must be a PSNR"]),
        (["--gpus", "4", "--parallel", "ditango", "--target-psnr", "nan"], ["--target-psnr must be a PSNR"]),
        (
            ["--gpus", "4", "--parallel", "ditango", "--target-psnr", "40", "--cache-ratio", "0.5"],
            ["give it or --cache-ratio, not both"],
        ),
        (
            ["--gpus", "2", "--parallel", "ring", "--target-psnr", "40"],
            ["--target-psnr only applies to --parallel ditango"],
        ),
    ],
)
def test_illegal_ditango_options(runner, out, extra, needles):
    run_error(runner, gen(out, *extra), *needles)


def test_parse_bytes():
    from planner.memory import parse_bytes

    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("500MB") == 500 * 10**6 and parse_bytes("1024") == 1024
    assert parse_bytes("1.5 kib") == 1536


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--gpus", "3", "--cfg-parallel"], ["--cfg-parallel needs an even number of ranks, got 3"]),
        (["--cfg-parallel"], ["--cfg-parallel needs an even number of ranks, got 1"]),
        (["--gpus", "2", "--cfg-parallel", "--guidance", "1.0"], ["--cfg-parallel needs guidance > 1"]),
        (["--gpus", "2", "--hybrid"], ["--hybrid needs --cfg-parallel"]),
        (["--gpus", "2", "--hybrid-k", "3"], ["--hybrid-k only applies with --hybrid"]),
        (["--gpus", "2", "--cfg-parallel", "--hybrid", "--hybrid-k", "-1"], ["--hybrid-k must be >= 0"]),
        (["--gpus", "2", "--cfg-parallel", "--hybrid", "--hybrid-split", "4"], ["--hybrid-split must be in [1, 3]"]),
        (["--gpus", "2", "--cfg-parallel", "--hybrid", "--hybrid-first-text", "x"], ["cond or uncond"]),
        (["--gpus", "4", "--cfg-parallel", "--hybrid", "--parallel", "ditango"], ["does not combine"]),
    ],
)
def test_illegal_cfg_and_hybrid_options(runner, out, extra, needles):
    run_error(runner, gen(out, *extra), *needles)


def test_cache_limit_too_small_is_caught_before_launch(runner, out):
    run_error(
        runner,
        [*gen(out, "--gpus", "4", "--parallel", "ditango", "--group-size", "1", "--cache-memory-limit", "1KB")],
        "cannot hold one cached unit per branch and layer",
    )
