"""The tiny HunyuanVideo (tiny_wan/hunyuan.py) runs diffusers' HunyuanVideoPipeline as the real one."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_wan.hunyuan import (
    DEFAULT_CROP_START,
    TEMPLATE,
    TINY_HUNYUAN,
    TinyHunyuanConfig,
    build_tiny_hunyuan,
    crop_start,
    prompt_template,
)

PROMPT = "a red circle moving left on a black background"
NEGATIVE = "a blue square moving up"
SIZE = {"height": 32, "width": 48, "num_frames": 5}  # latents 2 x 4 x 6: 2 x 2 x 3 tokens of 2x2 patches
STEPS = 2
ROUND_TRIP_TOL = 1e-5
PADDING_TOL = 1e-5  # masked padding vs no padding: float rounding only (measured ~1e-7)


@pytest.fixture(scope="module")
def components() -> dict:
    return build_tiny_hunyuan(TINY_HUNYUAN)


@pytest.fixture(scope="module")
def pipe(components):
    from diffusers import HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, **kwargs) -> torch.Tensor:
    args = {
        "prompt": PROMPT,
        **SIZE,
        "num_inference_steps": STEPS,
        "guidance_scale": 6.0,
        "generator": torch.Generator("cpu").manual_seed(0),
        "output_type": "latent",
        "prompt_template": prompt_template(pipe.tokenizer),
        **kwargs,
    }
    return pipe(**args).frames


def test_components_are_the_pipelines_frozen_and_seeded(components):
    from diffusers import HunyuanVideoPipeline

    assert set(components) == set(HunyuanVideoPipeline._get_signature_keys(HunyuanVideoPipeline)[0])
    for name, module in components.items():
        if isinstance(module, torch.nn.Module):
            assert not module.training, name
            assert not any(p.requires_grad for p in module.parameters()), name
    cfg = components["transformer"].config
    assert cfg.guidance_embeds and sum(cfg.rope_axes_dim) == cfg.attention_head_dim
    assert cfg.text_embed_dim == components["text_encoder"].config.hidden_size
    assert cfg.pooled_projection_dim == components["text_encoder_2"].config.hidden_size
    assert components["scheduler"].config.shift == 7.0
    again = build_tiny_hunyuan(TINY_HUNYUAN)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = components[name].state_dict(), again[name].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    other = build_tiny_hunyuan(TinyHunyuanConfig(seed=1))["transformer"].state_dict()
    assert not torch.equal(other["proj_out.weight"], components["transformer"].state_dict()["proj_out.weight"])


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="rope_axes_dim"):
        TinyHunyuanConfig(rope_axes_dim=(4, 4, 6))
    with pytest.raises(ValueError, match="hidden_states"):
        TinyHunyuanConfig(llama_layers=2)


def test_template_is_in_the_vocabulary_and_the_crop_starts_at_the_prompt(pipe):
    tok = pipe.tokenizer
    formatted = tok(TEMPLATE.format(PROMPT))["input_ids"]
    assert tok.unk_token_id not in formatted
    crop = crop_start(tok)
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    # after the crop: the prompt's tokens, then <|eot_id|>
    assert formatted[crop:] == [*prompt_ids, tok.convert_tokens_to_ids("<|eot_id|>")]
    assert crop != DEFAULT_CROP_START  # so callers must pass prompt_template(tok) (see hunyuan.py)
    # the pipeline computes the same crop itself when the template dict has none
    ours, ours_mask = pipe._get_llama_prompt_embeds(PROMPT, prompt_template(tok), max_sequence_length=32)
    computed, computed_mask = pipe._get_llama_prompt_embeds(PROMPT, {"template": TEMPLATE}, max_sequence_length=32)
    assert torch.equal(ours, computed) and torch.equal(ours_mask, computed_mask)
    assert ours.shape == (1, 32, TINY_HUNYUAN.llama_dim)
    assert ours_mask.sum().item() == len(prompt_ids) + 1 and ours_mask[0, : len(prompt_ids) + 1].all()
    # with the default dict's crop of 95 the prompt's first token would be lost
    _, default_mask = pipe._get_llama_prompt_embeds(
        PROMPT, {"template": TEMPLATE, "crop_start": DEFAULT_CROP_START}, max_sequence_length=32
    )
    assert default_mask.sum().item() == len(prompt_ids) + 1 - (DEFAULT_CROP_START - crop)


def test_pipeline_gives_finite_latents_of_the_video_shape(pipe):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)
    try:
        latents = generate(pipe)
    finally:
        handle.remove()
    assert latents.shape == (1, TINY_HUNYUAN.latent_channels, 2, 4, 6)
    assert torch.isfinite(latents).all() and latents.abs().max() > 0
    assert len(calls) == STEPS  # no true CFG by default: one forward per step
    kwargs = calls[0]
    assert kwargs["encoder_hidden_states"].shape == (1, 256, TINY_HUNYUAN.llama_dim)  # max_sequence_length
    assert torch.equal(kwargs["guidance"], torch.tensor([6000.0]))  # guidance_scale * 1000, embedded
    assert torch.equal(generate(pipe), latents)


def test_embedded_guidance_changes_the_latents(pipe):
    assert not torch.allclose(generate(pipe, guidance_scale=1.0), generate(pipe, guidance_scale=6.0))


def test_true_cfg_runs_the_negative_branch_and_changes_the_latents(pipe):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)
    try:
        cfg = generate(pipe, true_cfg_scale=4.0, negative_prompt=NEGATIVE)
    finally:
        handle.remove()
    assert len(calls) == 2 * STEPS
    cond, uncond = calls[0], calls[1]
    assert not torch.equal(cond["encoder_hidden_states"], uncond["encoder_hidden_states"])
    assert torch.equal(cond["guidance"], uncond["guidance"])  # both branches get the embedded guidance
    plain = generate(pipe)
    assert torch.isfinite(cfg).all()
    assert (cfg - plain).abs().max() > 1e-3
    # a negative prompt alone (true_cfg_scale 1) is ignored
    assert torch.equal(generate(pipe, negative_prompt=NEGATIVE), plain)


def test_decoded_video_has_the_requested_size(pipe):
    video = generate(pipe, output_type="pt")
    assert video.shape == (1, SIZE["num_frames"], 3, SIZE["height"], SIZE["width"])
    assert torch.isfinite(video).all()


def test_dropping_the_text_padding_is_exact_with_batch_1(pipe):
    """What a context-parallel adapter relies on: the transformer masks padded text keys, so
    for one sample the valid text tokens alone give the same video prediction."""
    embeds, mask = pipe._get_llama_prompt_embeds(PROMPT, prompt_template(pipe.tokenizer), max_sequence_length=24)
    pooled = pipe._get_clip_prompt_embeds(PROMPT)
    valid = int(mask.sum())
    assert 0 < valid < mask.shape[1]
    latents = torch.randn(1, TINY_HUNYUAN.latent_channels, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    common = {
        "hidden_states": latents,
        "timestep": torch.tensor([700.0]),
        "pooled_projections": pooled,
        "guidance": torch.tensor([6000.0]),
        "return_dict": False,
    }
    with torch.no_grad():
        padded = pipe.transformer(encoder_hidden_states=embeds, encoder_attention_mask=mask, **common)[0]
        cropped = pipe.transformer(
            encoder_hidden_states=embeds[:, :valid], encoder_attention_mask=mask[:, :valid], **common
        )[0]
        # the padding is not inert without the mask: the test can tell
        unmasked = pipe.transformer(
            encoder_hidden_states=embeds, encoder_attention_mask=torch.ones_like(mask), **common
        )[0]
    assert padded.shape == latents.shape
    assert (padded - cropped).abs().max().item() <= PADDING_TOL
    assert (padded - unmasked).abs().max().item() > 1e-4


def test_save_and_load_round_trip(pipe, tmp_path):
    from diffusers import HunyuanVideoPipeline

    before = generate(pipe, true_cfg_scale=3.0, negative_prompt=NEGATIVE)
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideoPipeline"
    assert index["transformer"] == ["diffusers", "HunyuanVideoTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLHunyuanVideo"]
    assert index["text_encoder"] == ["transformers", "LlamaModel"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModel"]
    assert list(tmp_path.glob("transformer/*.safetensors")) and not list(tmp_path.glob("**/*.bin"))
    loaded = HunyuanVideoPipeline.from_pretrained(tmp_path, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    assert crop_start(loaded.tokenizer) == crop_start(pipe.tokenizer)
    after = generate(loaded, true_cfg_scale=3.0, negative_prompt=NEGATIVE)
    assert (after - before).abs().max().item() <= ROUND_TRIP_TOL
