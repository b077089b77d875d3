"""The tiny HunyuanVideo-1.5 (tiny_wan/hunyuan15.py) runs diffusers' HunyuanVideo15Pipeline and
HunyuanVideo15ImageToVideoPipeline as the real checkpoints do."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny_wan.hunyuan15 import (
    CROP_START,
    SYSTEM_MESSAGE,
    TINY_HUNYUAN15,
    TinyHunyuan15Config,
    build_tiny_hunyuan15,
    template_prefix_length,
)

PROMPT = "a red circle moving left on a black background"
GLYPH_PROMPT = 'a sign that says "hello"'
NEGATIVE = "a blue square moving up"
SIZE = {"height": 32, "width": 48, "num_frames": 5}  # latents 2 x 2 x 3 (16x spatial, 4x temporal)
LATENT_SHAPE = (1, TINY_HUNYUAN15.latent_channels, 2, 2, 3)
STEPS = 2
ROUND_TRIP_TOL = 1e-5
# What the chat template puts after the prompt: <|im_end|> \n <|im_start|> assistant \n
SUFFIX_TOKENS = 5


@pytest.fixture(scope="module")
def components() -> dict:
    return build_tiny_hunyuan15(TINY_HUNYUAN15)


@pytest.fixture(scope="module")
def pipe(components):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, **kwargs) -> torch.Tensor:
    args = {
        "prompt": PROMPT,
        **SIZE,
        "num_inference_steps": STEPS,
        "generator": torch.Generator("cpu").manual_seed(0),
        "output_type": "latent",
        **kwargs,
    }
    return pipe(**args).frames


def generate_recording(pipe, **kwargs) -> tuple[torch.Tensor, list[dict]]:
    """The latents and the keyword arguments of every transformer call."""
    calls: list[dict] = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)
    try:
        return generate(pipe, **kwargs), calls
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def baseline(pipe) -> tuple[torch.Tensor, list[dict]]:
    """The default call: PROMPT, no negative prompt, the checkpoint's CFG scale."""
    return generate_recording(pipe)


@pytest.fixture(scope="module")
def unguided(components):
    """The same weights with the guider at scale 1: CFG off, one transformer call per step."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline(**{**components, "guider": ClassifierFreeGuidance(guidance_scale=1.0)})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_components_are_the_pipelines_frozen_and_seeded(components):
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    assert set(components) == set(HunyuanVideo15Pipeline._get_signature_keys(HunyuanVideo15Pipeline)[0])
    image = build_tiny_hunyuan15(TINY_HUNYUAN15, image=True)
    i2v_keys = HunyuanVideo15ImageToVideoPipeline._get_signature_keys(HunyuanVideo15ImageToVideoPipeline)[0]
    assert set(image) == set(i2v_keys)
    for name, module in image.items():
        if isinstance(module, torch.nn.Module):
            assert not module.training, name
            assert not any(p.requires_grad for p in module.parameters()), name
    cfg = components["transformer"].config
    assert cfg.task_type == "t2v" and image["transformer"].config.task_type == "i2v"
    assert sum(cfg.rope_axes_dim) == cfg.attention_head_dim and cfg.patch_size == 1
    assert cfg.in_channels == 2 * TINY_HUNYUAN15.latent_channels + 1
    assert cfg.text_embed_dim == components["text_encoder"].config.hidden_size
    assert cfg.text_embed_2_dim == components["text_encoder_2"].config.d_model
    assert cfg.image_embed_dim == image["image_encoder"].config.hidden_size
    assert components["scheduler"].config.shift == 5.0
    assert components["guider"].guidance_scale == 6.0
    assert (components["vae"].spatial_compression_ratio, components["vae"].temporal_compression_ratio) == (16, 4)
    again = build_tiny_hunyuan15(TINY_HUNYUAN15)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = components[name].state_dict(), again[name].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        c = image[name].state_dict()  # the I2V variant shares every weight
        assert all(torch.equal(a[k], c[k]) for k in a), name
    other = build_tiny_hunyuan15(TinyHunyuan15Config(seed=1))["transformer"].state_dict()
    assert not torch.equal(other["proj_out.weight"], components["transformer"].state_dict()["proj_out.weight"])


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="rope_axes_dim"):
        TinyHunyuan15Config(rope_axes_dim=(4, 4, 6))
    with pytest.raises(ValueError, match="hidden_states"):
        TinyHunyuan15Config(qwen_layers=2)
    with pytest.raises(ValueError, match="mrope_section"):
        TinyHunyuan15Config(mrope_section=(2, 2, 2))
    with pytest.raises(ValueError, match="latent_channels"):
        TinyHunyuan15Config(latent_channels=3)


def test_the_hard_coded_crop_starts_at_the_prompt(pipe):
    """The pipeline drops the first 108 tokens, the real Qwen tokenizer's template prefix; the tiny
    tokenizer's prefix is 108 tokens too, so the crop keeps the prompt and nothing before it."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    tok = pipe.tokenizer
    assert pipe.prompt_template_encode_start_idx == CROP_START == 108
    assert pipe.system_message == SYSTEM_MESSAGE
    assert template_prefix_length(tok) == CROP_START

    def ids(prompt: str) -> list[int]:  # as _get_mllm_prompt_embeds tokenizes, without the padding
        chat = format_text_input([prompt], pipe.system_message)
        out = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"][0])

    empty = ids("")  # the pipeline sends an empty prompt as " "
    assert tok.unk_token_id not in empty
    assert len(empty) == CROP_START + 1 + SUFFIX_TOKENS
    around_the_crop = tok.convert_ids_to_tokens(empty[CROP_START - 3 : CROP_START + 2])
    assert around_the_crop == ["<|im_start|>", "user", "\n", " ", "<|im_end|>"]
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in prompt_ids
    full = ids(PROMPT)
    assert full[:CROP_START] == empty[:CROP_START]
    assert full[CROP_START:] == [*prompt_ids, *empty[CROP_START + 1 :]]
    # through the pipeline: after the crop, the prompt's tokens and the suffix are valid, then padding
    embeds, mask, _, _ = pipe.encode_prompt(PROMPT, device=torch.device("cpu"))
    assert embeds.shape == (1, pipe.tokenizer_max_length, TINY_HUNYUAN15.qwen_dim)
    valid = len(prompt_ids) + SUFFIX_TOKENS
    assert mask.sum().item() == valid and mask[0, :valid].all()


def test_pipeline_gives_finite_latents_and_runs_byt5_only_on_quoted_text(pipe, unguided, baseline):
    latents, calls = baseline
    assert latents.shape == LATENT_SHAPE
    assert torch.isfinite(latents).all() and latents.abs().max() > 0
    assert len(calls) == 2 * STEPS  # CFG at 6.0: a conditional and an unconditional forward per step
    cond = calls[0]
    assert cond["hidden_states"].shape == (1, 2 * TINY_HUNYUAN15.latent_channels + 1, *LATENT_SHAPE[2:])
    assert cond["encoder_hidden_states"].shape == (1, pipe.tokenizer_max_length, TINY_HUNYUAN15.qwen_dim)
    # text-to-video: 729 zero image tokens (masked out by the transformer)
    assert cond["image_embeds"].shape == (1, pipe.vision_num_semantic_tokens, TINY_HUNYUAN15.siglip_dim)
    assert not cond["image_embeds"].any()
    # no quoted text: ByT5 is skipped (zeros, nothing valid)
    assert cond["encoder_hidden_states_2"].shape == (1, pipe.tokenizer_2_max_length, TINY_HUNYUAN15.t5_dim)
    assert cond["encoder_attention_mask_2"].sum() == 0 and not cond["encoder_hidden_states_2"].any()

    # quoted text: ByT5 encodes 'Text "hello". ' (one conditional forward per step without CFG)
    glyph, glyph_calls = generate_recording(unguided, prompt=GLYPH_PROMPT)
    assert glyph.shape == LATENT_SHAPE and torch.isfinite(glyph).all()
    assert glyph_calls[0]["encoder_attention_mask_2"].sum() == len(b'Text "hello". ') + 1  # its bytes and </s>
    assert glyph_calls[0]["encoder_hidden_states_2"].any()


def test_guidance_scale_and_negative_prompt_change_the_latents(pipe, unguided, baseline):
    latents, _ = baseline
    plain, calls = generate_recording(unguided)
    assert len(calls) == STEPS
    assert torch.isfinite(plain).all() and (plain - latents).abs().max() > 1e-3
    negative = generate(pipe, negative_prompt=NEGATIVE)
    assert torch.isfinite(negative).all() and (negative - latents).abs().max() > 1e-3


def test_decoded_video_has_the_requested_size(unguided):
    video = generate(unguided, output_type="pt")
    assert video.shape == (1, SIZE["num_frames"], 3, SIZE["height"], SIZE["width"])
    assert torch.isfinite(video).all() and video.min() >= 0 and video.max() <= 1


def test_save_and_load_round_trip(pipe, baseline, tmp_path):
    from diffusers import HunyuanVideo15Pipeline

    before, _ = baseline
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideo15Pipeline"
    assert index["transformer"] == ["diffusers", "HunyuanVideo15Transformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLHunyuanVideo15"]
    assert index["guider"] == ["diffusers", "ClassifierFreeGuidance"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert index["tokenizer_2"] == ["transformers", "ByT5Tokenizer"]
    assert list(tmp_path.glob("transformer/*.safetensors")) and not list(tmp_path.glob("**/*.bin"))
    loaded = HunyuanVideo15Pipeline.from_pretrained(tmp_path, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    assert template_prefix_length(loaded.tokenizer) == CROP_START  # the chat template survives
    assert loaded.scheduler.config.shift == 5.0 and loaded.guider.guidance_scale == 6.0
    after = generate(loaded)
    assert (after - before).abs().max().item() <= ROUND_TRIP_TOL


def test_image_to_video_gives_finite_latents():
    import PIL.Image
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline

    # CFG off (scale 1) to halve the transformer calls; the T2V tests cover the unconditional branch
    components = {**build_tiny_hunyuan15(TINY_HUNYUAN15, image=True), "guider": ClassifierFreeGuidance(1.0)}
    pipe = HunyuanVideo15ImageToVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    pixels = np.random.default_rng(0).integers(0, 256, (SIZE["height"], SIZE["width"], 3), dtype=np.uint8)
    image = PIL.Image.fromarray(pixels)  # 3:2; target_size 40 picks the 32 x 48 bucket
    calls: list[dict] = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)
    try:
        latents = pipe(
            image=image,
            prompt=PROMPT,
            num_frames=SIZE["num_frames"],
            num_inference_steps=STEPS,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="latent",
        ).frames
    finally:
        handle.remove()
    assert latents.shape == LATENT_SHAPE
    assert torch.isfinite(latents).all() and latents.abs().max() > 0
    assert len(calls) == STEPS
    cond = calls[0]
    # SigLIP's 27 x 27 patch tokens, as many as the real so400m-patch14-384 gives
    assert cond["image_embeds"].shape == (1, pipe.vision_num_semantic_tokens, TINY_HUNYUAN15.siglip_dim)
    assert cond["image_embeds"].any()  # nonzero: the transformer attends to them
    channels = TINY_HUNYUAN15.latent_channels
    condition, mask = cond["hidden_states"][:, channels:-1], cond["hidden_states"][:, -1]
    assert condition[:, :, 0].any() and not condition[:, :, 1:].any()  # the image's latents in frame 0
    assert mask[:, 0].eq(1).all() and not mask[:, 1:].any()
