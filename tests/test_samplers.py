"""`--scheduler`, `--flow-shift`, `--fps` and the family's default negative prompt, each against
diffusers' own pipeline with the same settings (a tiny random Wan and HunyuanVideo)."""

from __future__ import annotations

import json

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline
from safetensors.torch import load_file

from ditango_cli.app import app
from runtime.models.hunyuan.shapes import NEGATIVE_PROMPT as HUNYUAN_NEGATIVE
from runtime.models.schedulers import Sampler
from runtime.models.wan.shapes import NEGATIVE_PROMPT as WAN_NEGATIVE
from tests import test_hunyuan as hy

ATOL = 1e-5
TEXT_LEN = 512  # a directory's default, as the CLI runs it
SIZE = dict(height=32, width=48, num_frames=5)
ARGS = ["--prompt", "a red kite", "--steps", "4", "--height", "32", "--width", "48", "--frames", "5",
        "--guidance", "4.0", "--seed", "5", "--device", "cpu", "--quiet", "--save-latents"]  # fmt: skip


def swap_scheduler(pipe, name: str | None, shift: float | None) -> None:
    """What a diffusers user writes to run another solver or shift."""
    config = pipe.scheduler.config
    if name == "euler":
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, shift=shift)
    elif name == "dpm++":
        pipe.scheduler = DPMSolverMultistepScheduler.from_config(
            config, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
        )
    elif name == "unipc" and shift is not None:
        pipe.scheduler = UniPCMultistepScheduler.from_config(config, flow_shift=shift)


def wan_reference(model_dir, negative: str, scheduler: str | None = None, shift: float | None = None):
    pipe = WanPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    swap_scheduler(pipe, scheduler, shift)
    return pipe(
        prompt="a red kite",
        negative_prompt=negative,
        num_inference_steps=4,
        guidance_scale=4.0,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="latent",
        max_sequence_length=TEXT_LEN,
        **SIZE,
    ).frames


def generate(runner, model_dir, out, *extra) -> tuple[torch.Tensor, dict]:
    result = runner.invoke(app, ["generate", "--model", str(model_dir), "--out", str(out), *ARGS, *extra])
    assert result.exit_code == 0, result.stderr[-3000:]
    (sidecar,) = [p for p in out.glob("*.json") if p.name != "report.json"]
    record = json.loads(sidecar.read_text())
    return load_file(str(out / f"{record['id']}.latents.safetensors"))["latents"], record


@pytest.mark.parametrize(
    "scheduler, shift, recorded",
    [
        (None, None, ("unipc", 3.0)),
        ("unipc", 5.0, ("unipc", 5.0)),
        ("euler", 5.0, ("euler", 5.0)),
        ("dpm++", 2.0, ("dpm++", 2.0)),
    ],
    ids=["own", "unipc-5", "euler-5", "dpm-2"],
)
def test_a_solver_and_shift_give_the_pipelines_latents_and_are_recorded(
    runner, tmp_path, saved_model_dir, scheduler, shift, recorded
):
    extra = [*(["--scheduler", scheduler] if scheduler else []), *(["--flow-shift", str(shift)] if shift else [])]
    ours, record = generate(runner, saved_model_dir, tmp_path / "out", "--negative-prompt", "noise", *extra)
    ref = wan_reference(saved_model_dir, "noise", scheduler, shift)
    assert (ours - ref).abs().max().item() <= ATOL
    assert (record["scheduler"], record["flow_shift"]) == recorded
    if scheduler is not None:  # the option changes the video: the test could not pass with it ignored
        assert (ref - wan_reference(saved_model_dir, "noise")).abs().max().item() > 1e-3
        # Resuming the folder with the model's own solver is refused, as another step count is.
        again = runner.invoke(
            app,
            [
                "generate",
                "--model",
                str(saved_model_dir),
                "--out",
                str(tmp_path / "out"),
                *ARGS,
                "--negative-prompt",
                "noise",
            ],
        )
        made = "scheduler" if scheduler != "unipc" else "flow_shift"
        assert again.exit_code == 2 and f"was made with {made}" in again.stderr, again.stderr


def test_the_default_negative_prompt_is_the_authors_and_empty_means_none(runner, tmp_path, saved_model_dir):
    ours, record = generate(runner, saved_model_dir, tmp_path / "default")
    assert record["negative_prompt"] == WAN_NEGATIVE
    assert (ours - wan_reference(saved_model_dir, WAN_NEGATIVE)).abs().max().item() <= ATOL
    none, record = generate(runner, saved_model_dir, tmp_path / "none", "--negative-prompt", "")
    assert record["negative_prompt"] == ""
    assert (none - wan_reference(saved_model_dir, "")).abs().max().item() <= ATOL
    assert (ours - none).abs().max().item() > 1e-3


def mp4_fps(path) -> float:
    with imageio.get_reader(str(path)) as reader:
        return reader.get_meta_data()["fps"]


def test_fps_is_the_mp4s_as_diffusers_export_writes_it(runner, tmp_path, saved_model_dir):
    from diffusers.utils import export_to_video

    frames = [np.zeros((32, 48, 3), dtype=np.float32) for _ in range(5)]
    for extra, fps in ((["--fps", "24"], 24), ([], 16)):  # 16: Wan's own
        out = tmp_path / f"fps{fps}"
        _, record = generate(runner, saved_model_dir, out, "--negative-prompt", "", *extra)
        theirs = export_to_video(frames, str(tmp_path / f"theirs{fps}.mp4"), fps=fps)
        assert record["fps"] == fps and mp4_fps(out / f"{record['id']}.mp4") == mp4_fps(theirs) == fps
    result = runner.invoke(app, ["check", "--model", str(saved_model_dir), "--prompt", "a", "--fps", "0"])
    assert result.exit_code == 2 and "fps must be in [1, 240], got 0" in result.stderr


@pytest.mark.parametrize("sampler", [Sampler("euler", 2.0), Sampler("unipc", 3.0)], ids=["euler-2", "unipc-3"])
def test_hunyuan_runs_a_solver_and_shift_as_its_pipeline(sampler):
    den = hy.denoiser()
    text = den.encode_text(hy.PROMPT, None, 1.0, 6.0)
    size = hy.SIZES[4]
    x = den.initial_latents(3, size["height"], size["width"], size["frames"])
    ours = den.denoise(x, text, hy.STEPS, 1.0, sampler=sampler).latents_BCFHW

    from diffusers import HunyuanVideoPipeline

    components = hy.build_tiny_hunyuan()
    pipe = HunyuanVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    swap_scheduler(pipe, sampler.name, sampler.flow_shift)
    if sampler.name == "unipc":  # from the Euler config: the settings that make it a flow solver
        pipe.scheduler = UniPCMultistepScheduler.from_config(
            components["scheduler"].config,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=sampler.flow_shift,
        )
    ref = pipe(
        prompt=hy.PROMPT,
        guidance_scale=6.0,
        num_inference_steps=hy.STEPS,
        height=size["height"],
        width=size["width"],
        num_frames=size["frames"],
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
        max_sequence_length=hy.TEXT_LEN,
        prompt_template=hy.prompt_template(components["tokenizer"]),
    ).frames
    assert (ours - ref).abs().max().item() <= ATOL
    assert (ours - hy.ours(hy.denoiser(), size)).abs().max().item() > 1e-4, "the solver changes the latents"


def test_solver_and_shift_errors_are_one_line(runner, tmp_path, saved_model_dir):
    cases = [
        (["--scheduler", "heun"], "Invalid value for '--scheduler'"),
        (["--flow-shift", "0"], "flow shift must be a number in (0, 100], got 0.0"),
        (["--flow-shift", "nan"], "flow shift must be a number in (0, 100]"),
    ]
    for extra, needle in cases:
        result = runner.invoke(app, ["check", "--model", str(saved_model_dir), "--prompt", "a", *extra])
        assert result.exit_code == 2 and needle in result.stderr, result.stderr
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"prompt": "a", "scheduler": "ddim"}) + "\n")
    result = runner.invoke(app, ["check", "--model", str(saved_model_dir), "--prompts", str(batch)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "b.jsonl line 1: scheduler 'ddim' is not one of" in lines[0]


def test_each_family_has_its_authors_negative_prompt():
    from runtime.models.registry import REGISTRY

    assert REGISTRY["wan2.1-14b"].defaults.negative_prompt == WAN_NEGATIVE
    assert REGISTRY["hunyuanvideo"].defaults.negative_prompt == HUNYUAN_NEGATIVE
    assert REGISTRY["tiny-wan"].defaults.negative_prompt == ""  # trained without one


def test_a_distilled_setting_runs_one_branch_a_step_as_the_pipeline(parity_components):
    """Guidance 1, four steps, flow-match Euler at shift 5 (a step-distillation LoRA's settings):
    one transformer evaluation a step, and diffusers' latents."""
    from runtime.denoiser import Denoiser
    from runtime.models.loading import resolve_placement

    den = Denoiser(parity_components, resolve_placement("cpu"), 32)
    calls = []
    handle = den.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        text = den.encode_text("a blue square", "blurry", 1.0)
        x = den.initial_latents(7, 32, 32, 5)
        ours = den.denoise(x, text, 4, 1.0, sampler=Sampler("euler", 5.0)).latents_BCFHW
    finally:
        handle.remove()
    assert len(calls) == 4 and text.uncond_BLE is None
    pipe = WanPipeline(**parity_components)
    pipe.set_progress_bar_config(disable=True)
    swap_scheduler(pipe, "euler", 5.0)
    ref = pipe(
        prompt="a blue square",
        negative_prompt="blurry",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
        max_sequence_length=32,
    ).frames
    assert (ours - ref).abs().max().item() <= ATOL
