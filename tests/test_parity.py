"""Our denoising loop against diffusers' WanPipeline (the foundation contract)."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from ditango_cli.app import app
from runtime.denoiser import Denoiser
from runtime.models.loading import resolve_placement

PARITY_ATOL = 1e-5  # the bound for float32 on CPU
TEXT_LEN = 32


def reference_latents(components: dict, *, prompt, negative, seed, steps, guidance, height, width, frames):
    pipe = WanPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=prompt,
        negative_prompt=negative,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="latent",
        max_sequence_length=TEXT_LEN,
    ).frames


@pytest.mark.parametrize(
    "guidance,negative,height,width,frames,steps",
    [
        (4.5, "blurry, static", 48, 80, 9, 6),  # both CFG branches
        (1.0, "", 32, 32, 5, 4),  # guidance off: one branch
    ],
)
def test_denoise_matches_wan_pipeline(parity_components, guidance, negative, height, width, frames, steps):
    seed = 1234
    kwargs = dict(prompt="a blue square moving up", negative=negative, seed=seed, steps=steps, guidance=guidance)
    ref = reference_latents(parity_components, height=height, width=width, frames=frames, **kwargs)

    denoiser = Denoiser(parity_components, resolve_placement("cpu"), TEXT_LEN)
    init = denoiser.initial_latents(seed, height, width, frames)
    # Same seed => the same initial noise as WanPipeline's CPU generator.
    expected_init = torch.randn(init.shape, generator=torch.Generator("cpu").manual_seed(seed))
    assert torch.equal(init, expected_init)

    text = denoiser.encode_text("a blue square moving up", negative, guidance)
    assert (text.uncond_BLE is not None) == (guidance > 1.0)
    out = denoiser.denoise(init, text, steps, guidance).latents_BCFHW
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= PARITY_ATOL
    # The check is meaningful: denoising moved the latents far from the noise.
    assert (out - init).abs().max().item() > 1e-2


def test_guidance_changes_result(parity_components):
    """Guards against a loop that silently drops the unconditional branch."""
    denoiser = Denoiser(parity_components, resolve_placement("cpu"), TEXT_LEN)
    init = denoiser.initial_latents(3, 32, 32, 5)
    a = denoiser.denoise(init, denoiser.encode_text("a red ball", "", 1.0), 3, 1.0).latents_BCFHW
    b = denoiser.denoise(init, denoiser.encode_text("a red ball", "", 6.0), 3, 6.0).latents_BCFHW
    assert (a - b).abs().max().item() > 1e-3


def test_cli_latents_match_pipeline_from_directory(runner, saved_model_dir, tmp_path):
    """Whole path: local directory -> loader -> CLI -> saved latents == WanPipeline on the same dir."""
    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(saved_model_dir),
        "--prompt",
        "a green circle moving right",
        "--negative-prompt",
        "noise",
        "--seed",
        "42",
        "--steps",
        "5",
        "--guidance",
        "5.0",
        "--height",
        "32",
        "--width",
        "48",
        "--frames",
        "5",
        "--out",
        str(out),
        "--save-latents",
        "--device",
        "cpu",
        "--quiet",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    files = sorted(out.glob("*.latents.safetensors"))
    assert len(files) == 1
    ours = load_file(files[0])["latents"]

    pipe = WanPipeline.from_pretrained(saved_model_dir, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        prompt="a green circle moving right",
        negative_prompt="noise",
        height=32,
        width=48,
        num_frames=5,
        num_inference_steps=5,
        guidance_scale=5.0,
        generator=torch.Generator("cpu").manual_seed(42),
        output_type="latent",
        max_sequence_length=512,
    ).frames
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= PARITY_ATOL


def test_decode_matches_wan_pipeline(parity_components):
    """VAE decode incl. latents_mean/std un-normalisation (non-trivial in the parity config)."""
    assert parity_components["vae"].config.latents_std[3] != 1.0
    pipe = WanPipeline(**parity_components)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red ball", negative_prompt="", height=32, width=48, num_frames=5, num_inference_steps=2)
    theirs = pipe(
        **kwargs, generator=torch.Generator("cpu").manual_seed(9), output_type="np", max_sequence_length=TEXT_LEN
    ).frames[0]
    latents = reference_latents(
        parity_components,
        prompt="a red ball",
        negative="",
        seed=9,
        steps=2,
        guidance=5.0,
        height=32,
        width=48,
        frames=5,
    )
    ours = Denoiser(parity_components, resolve_placement("cpu"), TEXT_LEN).decode(latents)
    assert ours.shape == theirs.shape == (5, 32, 48, 3)
    expected = (theirs.clip(0, 1) * 255).round().astype("uint8")
    assert (ours == expected).all()


def test_the_built_in_model_matches_wan_pipeline():
    """The in-process path on the built-in model's own weights, components shared with the pipeline."""
    from runtime.models.loading import load_components
    from runtime.models.resolve import resolve_model

    resolved = resolve_model("tiny-wan")
    placement = resolve_placement("cpu")
    components = load_components(resolved, placement)
    kwargs = dict(prompt="a red circle moving left", negative="", seed=5, steps=4, guidance=2.5)
    ref = reference_latents(components, height=64, width=96, frames=9, **kwargs)
    denoiser = Denoiser(components, placement, TEXT_LEN)
    init = denoiser.initial_latents(5, 64, 96, 9)
    out = denoiser.denoise(init, denoiser.encode_text("a red circle moving left", "", 2.5), 4, 2.5).latents_BCFHW
    assert (out - ref).abs().max().item() <= PARITY_ATOL and (out - init).abs().max().item() > 1e-2
