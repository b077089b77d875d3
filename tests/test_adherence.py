"""The shipped tiny-wan follows its prompts as the checker reads them from decoded frames
(the model's default steps and guidance): colour, background and motion direction.
"""

from __future__ import annotations

import functools

import imageio.v3 as iio
import pytest

from ditango_cli.app import app
from runtime.denoiser import Denoiser
from runtime.models.loading import load_components, resolve_placement
from runtime.models.resolve import resolve_model
from tiny_wan.data import eval_prompts
from tiny_wan.judge import judge

COLOUR_BAR, DIRECTION_BAR = 0.90, 0.80  # the bars over 20 prompts


@functools.cache  # the slow tests share one generation of the 20 prompts
def adherence(n_prompts: int, seed: int = 0) -> dict[str, float]:
    prompts = eval_prompts(n_prompts)
    resolved = resolve_model("tiny-wan")
    d = resolved.spec.defaults
    placement = resolve_placement("cpu")
    den = Denoiser(load_components(resolved, placement), placement, d.max_text_len)
    hits = {"colour": 0, "direction": 0, "background": 0}
    for prompt in prompts:
        text = den.encode_text(prompt.caption, d.negative_prompt, d.guidance)
        latents = den.initial_latents(seed, d.height, d.width, d.frames)
        frames = den.decode(den.denoise(latents, text, d.steps, d.guidance).latents_BCFHW)
        verdict = judge(frames).matches(prompt)
        for key in hits:
            hits[key] += verdict[key]
    return {k: v / len(prompts) for k, v in hits.items()}


@pytest.mark.e2e
def test_the_readme_prompt_through_the_cli(runner, tmp_path):
    """No --model: the default model draws a green object moving right on a gray background, read from the MP4."""
    result = runner.invoke(
        app, ["generate", "--prompt", "a green square moving right on a gray background", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.stderr
    (video,) = tmp_path.glob("*.mp4")
    verdict = judge(iio.imread(video))
    assert (verdict.colour, verdict.direction, verdict.background) == ("green", "right", "gray"), verdict


@pytest.mark.e2e
def test_colour_background_and_direction_on_a_small_prompt_set():
    """CI's share of the adherence check: 8 prompts (every colour and direction, both backgrounds)."""
    scores = adherence(8)
    assert scores["colour"] >= COLOUR_BAR and scores["background"] == 1.0, scores
    assert scores["direction"] >= DIRECTION_BAR, scores


@pytest.mark.slow
def test_colour_and_background_over_twenty_prompts():
    scores = adherence(20)
    assert scores["colour"] >= COLOUR_BAR and scores["background"] >= COLOUR_BAR, scores


@pytest.mark.slow
def test_direction_over_twenty_prompts():
    assert adherence(20)["direction"] >= DIRECTION_BAR
