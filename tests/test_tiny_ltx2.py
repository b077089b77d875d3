"""The tiny LTX-2 (tiny_wan/ltx2.py) is the real Lightricks/LTX-2 layout with tiny sizes: it saves and
loads back through diffusers' LTX2Pipeline, and its video latents, audio latents and waveform have the
lengths the real model's strides give."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tiny_wan.ltx2 import (
    CALL_KWARGS,
    REAL_SCHEDULER_CONFIG,
    REAL_TRANSFORMER_CONFIG,
    TINY_LTX2,
    TinyLTX2Config,
    build_tiny_ltx2,
    save_tiny_ltx2,
    tiny_configs,
)

PROMPT = "a red circle moving left on a black background"
# Unequal H and W and 3 latent frames make a swapped axis visible: latents 3 x 2 x 3 (8x, 32x, 32x).
SIZE = {"height": 64, "width": 96, "num_frames": 17, "frame_rate": 24.0}
VIDEO_LATENT_SHAPE = (1, TINY_LTX2.latent_channels, 3, 2, 3)
ROUND_TRIP_TOL = 1e-6
STG_NOOP_TOL = 1e-5  # a batch-1 call against the batch-2 CFG call: rounding only
# Sizes the tiny model may change; every other constructor argument stays the real one.
SIZE_KEYS = {
    "transformer": {
        "in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "cross_attention_dim",
        "audio_in_channels", "audio_out_channels", "audio_num_attention_heads", "audio_attention_head_dim",
        "audio_cross_attention_dim", "num_layers", "caption_channels",
    },
    "connectors": {
        "caption_channels", "text_proj_in_factor", "video_connector_num_attention_heads",
        "video_connector_attention_head_dim", "video_connector_num_layers", "audio_connector_num_attention_heads",
        "audio_connector_attention_head_dim", "audio_connector_num_layers",
    },
    "vae": {"latent_channels", "block_out_channels", "decoder_block_out_channels", "layers_per_block",
            "decoder_layers_per_block"},
    "audio_vae": {"base_channels", "num_res_blocks", "latent_channels", "mel_bins"},
    "vocoder": {"in_channels", "hidden_channels"},
}  # fmt: skip


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_ltx2()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_ltx2(tmp_path_factory.mktemp("tiny-ltx2"))


@pytest.fixture(scope="module")
def loaded(saved):
    from diffusers import LTX2Pipeline

    loaded = LTX2Pipeline.from_pretrained(saved, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    return loaded


def generate(pipe, output_type: str = "latent", record: list | None = None, **kwargs):
    """One 2-step generation at SIZE, seed 0; `record` collects every transformer call's kwargs."""
    args = {
        **CALL_KWARGS,
        **SIZE,
        "prompt": PROMPT,
        "generator": torch.Generator("cpu").manual_seed(0),
        "output_type": output_type,
        **kwargs,
    }
    handle = None
    if record is not None:
        handle = pipe.transformer.register_forward_pre_hook(lambda m, a, k: record.append(k), with_kwargs=True)
    try:
        return pipe(**args)
    finally:
        if handle is not None:
            handle.remove()


@pytest.fixture(scope="module")
def baseline(pipe):
    calls: list[dict] = []
    return generate(pipe, record=calls), calls


def audio_latent_frames(pipe, num_frames: int, frame_rate: float) -> int:
    """The pipeline's audio length: the video's seconds in audio latent frames (mel frames / 4)."""
    vae = pipe.audio_vae
    per_second = vae.config.sample_rate / vae.config.mel_hop_length / vae.temporal_compression_ratio
    return round(num_frames / frame_rate * per_second)


def public(config) -> dict:
    """A config without its bookkeeping keys (_class_name, _diffusers_version, ...)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def test_saved_layout_names_the_real_classes(saved):
    index = json.loads((saved / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    assert index["transformer"] == ["diffusers", "LTX2VideoTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLLTX2Video"]
    assert index["audio_vae"] == ["diffusers", "AutoencoderKLLTX2Audio"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert index["connectors"] == ["ltx2", "LTX2TextConnectors"]
    assert index["vocoder"] == ["ltx2", "LTX2Vocoder"]
    assert index["text_encoder"] == ["transformers", "Gemma3ForConditionalGeneration"]
    assert index["tokenizer"][0] == "transformers"
    assert list(saved.glob("transformer/*.safetensors")) and not list(saved.glob("**/*.bin"))


def test_tiny_configs_differ_from_the_real_ones_only_in_sizes(pipe):
    from tiny_wan import ltx2

    real = {
        "transformer": ltx2.REAL_TRANSFORMER_CONFIG,
        "connectors": ltx2.REAL_CONNECTORS_CONFIG,
        "vae": ltx2.REAL_VIDEO_VAE_CONFIG,
        "audio_vae": ltx2.REAL_AUDIO_VAE_CONFIG,
        "vocoder": ltx2.REAL_VOCODER_CONFIG,
    }
    for name, tiny in tiny_configs().items():
        assert set(tiny) == set(real[name]), name
        changed = {k for k in tiny if tiny[k] != real[name][k]}
        assert changed <= SIZE_KEYS[name], (name, changed - SIZE_KEYS[name])
        built = getattr(pipe, name).config  # and the modules were built from them
        same = [
            np.array_equal(np.asarray(built[k], dtype=object), np.asarray(v, dtype=object)) for k, v in tiny.items()
        ]
        assert all(same), name
    assert {k: pipe.scheduler.config[k] for k in REAL_SCHEDULER_CONFIG} == dict(REAL_SCHEDULER_CONFIG)


def test_shapes_fit_together_as_in_the_real_model(pipe):
    t, c = pipe.transformer.config, pipe.connectors.config
    assert (pipe.vae.spatial_compression_ratio, pipe.vae.temporal_compression_ratio) == (32, 8)
    assert (pipe.audio_vae.mel_compression_ratio, pipe.audio_vae.temporal_compression_ratio) == (4, 4)
    # 2-way Ulysses splits the heads of both streams; a2v / v2a attention uses the audio heads
    assert t.num_attention_heads % 2 == 0 and t.audio_num_attention_heads % 2 == 0
    assert c.video_connector_num_attention_heads % 2 == 0 and c.audio_connector_num_attention_heads % 2 == 0
    gemma = pipe.text_encoder.config.text_config
    assert t.caption_channels == c.caption_channels == gemma.hidden_size
    assert c.text_proj_in_factor == gemma.num_hidden_layers + 1
    assert c.video_connector_num_learnable_registers == c.audio_connector_num_learnable_registers == 128
    assert t.in_channels == pipe.vae.config.latent_channels
    audio = pipe.audio_vae.config
    assert t.audio_in_channels == audio.latent_channels * audio.mel_bins // 4 == audio.base_channels
    voc = pipe.vocoder.config
    assert voc.in_channels == audio.output_channels * audio.mel_bins
    # 100 mel frames a second, 240 samples each: the vocoder's 24 kHz
    assert math.prod(voc.upsample_factors) * audio.sample_rate / audio.mel_hop_length == voc.output_sampling_rate


def test_tokenizer_pads_left_after_gemma_bos(pipe):
    tok = pipe.tokenizer
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.model_max_length == 1024
    embeds, mask = pipe._get_gemma_prompt_embeds(PROMPT, max_sequence_length=128, device=torch.device("cpu"))
    words = len(PROMPT.split())
    assert mask.shape == (1, 128) and mask.sum() == words + 1  # <bos> and one token a word
    assert not mask[0, : 128 - words - 1].any()  # left padding
    assert tok.unk_token_id not in tok(PROMPT)["input_ids"]
    layers = pipe.text_encoder.config.text_config.num_hidden_layers + 1
    assert embeds.shape == (1, 128, TINY_LTX2.gemma_dim * layers)


def test_connectors_replace_the_padding_with_registers(pipe):
    """As the real connectors: the valid (left-padded) tokens move to the front and the learnable
    registers fill the rest, so the 1-D transformers see no padding."""
    length = CALL_KWARGS["max_sequence_length"]  # = the 128 registers
    embeds, mask = pipe._get_gemma_prompt_embeds(PROMPT, max_sequence_length=length, device=torch.device("cpu"))
    valid = int(mask.sum())
    seen: list[torch.Tensor] = []
    for connector in (pipe.connectors.video_connector, pipe.connectors.audio_connector):
        block = connector.transformer_blocks[0]
        handle = block.register_forward_pre_hook(
            lambda m, a, k: seen.append(a[0] if a else k["hidden_states"]), with_kwargs=True
        )
        try:
            pipe.connectors(embeds, mask, padding_side="left")
        finally:
            handle.remove()
        registers = connector.learnable_registers
        assert registers.shape[0] == length
        tokens = seen[-1][0]  # what the first block gets: [S, D]
        assert torch.equal(tokens[valid:], registers[valid:].to(tokens.dtype))
        assert not torch.allclose(tokens[:valid], registers[:valid]) and tokens[:valid].abs().sum(-1).gt(0).all()


def test_video_and_audio_latents_have_the_strided_shapes(pipe, baseline):
    out, calls = baseline
    assert out.frames.shape == VIDEO_LATENT_SHAPE
    frames = audio_latent_frames(pipe, SIZE["num_frames"], SIZE["frame_rate"])
    assert frames == 18  # round(17 / 24 * 16000 / 160 / 4) = round(17.7)
    assert out.audio.shape == (1, TINY_LTX2.audio_latent_channels, frames, TINY_LTX2.mel_bins // 4)
    assert torch.isfinite(out.frames).all() and torch.isfinite(out.audio).all()
    # CFG (batched pair), STG and modality isolation: three calls a step
    assert len(calls) == 3 * CALL_KWARGS["num_inference_steps"]
    first = calls[0]
    assert first["hidden_states"].shape == (2, 3 * 2 * 3, TINY_LTX2.latent_channels)
    assert first["audio_hidden_states"].shape == (2, frames, TINY_LTX2.audio_tokens_dim)
    # the connectors hand the transformer an all-ones text mask (padding holds registers, see below)
    assert first["encoder_attention_mask"].shape == (2, CALL_KWARGS["max_sequence_length"])
    assert first["encoder_attention_mask"].all()
    # shift_terminal 0.1 stretches the 2-step schedule from sigma 1 to 0.1
    assert [c["timestep"][0].item() for c in calls[::3]] == pytest.approx([1000.0, 100.0])


def test_loaded_pipeline_gives_the_same_latents(pipe, loaded, baseline):
    for name in ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder"):
        a, b = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    assert loaded.tokenizer.padding_side == "left" and loaded.tokenizer.model_max_length == 1024
    assert public(loaded.scheduler.config) == public(pipe.scheduler.config)
    before, _ = baseline
    after = generate(loaded)
    assert (after.frames - before.frames).abs().max().item() <= ROUND_TRIP_TOL
    assert (after.audio - before.audio).abs().max().item() <= ROUND_TRIP_TOL
    other = generate(loaded, generator=torch.Generator("cpu").manual_seed(1))
    assert (other.frames - before.frames).abs().max() > 1e-3  # the seed matters


def test_decoded_video_and_waveform_lengths(loaded):
    out = generate(loaded, output_type="np")
    video, audio = out.frames, out.audio
    assert video.shape == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3)
    assert np.isfinite(video).all() and video.min() >= 0 and video.max() <= 1
    cfg, voc = loaded.audio_vae.config, loaded.vocoder.config
    latent = audio_latent_frames(loaded, SIZE["num_frames"], SIZE["frame_rate"])
    # the causal audio decoder gives 4 mel frames per latent frame, less 3 for the causal first one
    mel_frames = 4 * latent - 3
    seconds = mel_frames * cfg.mel_hop_length / cfg.sample_rate
    hop = cfg.mel_hop_length * voc.output_sampling_rate // cfg.sample_rate  # 240 samples
    assert audio.shape[:2] == (1, 2)  # stereo
    assert abs(audio.shape[-1] - seconds * voc.output_sampling_rate) < hop
    assert audio.shape[-1] == mel_frames * hop
    # so the waveform is shorter than the video by those 3 frames and the rounding of `latent` (<= 2)
    video_samples = SIZE["num_frames"] / SIZE["frame_rate"] * voc.output_sampling_rate
    assert 0 < video_samples - audio.shape[-1] <= 5 * hop
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1  # tanh output


def test_stg_is_a_no_op_without_perturbed_attention(pipe, baseline):
    """LTX-2.0's config has perturbed_attn=False: the STG call is not perturbed, so stg_scale changes
    nothing; with the 2.3-style processor, the same blocks change the result."""
    from tiny_wan.ltx2 import build_tiny_ltx2_components

    before, _ = baseline
    no_stg = generate(pipe, stg_scale=0.0, audio_stg_scale=0.0)
    assert (no_stg.frames - before.frames).abs().max().item() <= STG_NOOP_TOL
    perturbed = build_tiny_ltx2(cfg=TinyLTX2Config(perturbed_attn=True))
    processor = perturbed.transformer.transformer_blocks[0].attn1.processor
    assert type(processor).__name__ == "LTX2PerturbedAttnProcessor"
    # same weights (the flag adds none), different guidance
    a = build_tiny_ltx2_components()["transformer"].state_dict()
    assert all(torch.equal(a[k], v) for k, v in perturbed.transformer.state_dict().items())
    assert (generate(perturbed).frames - before.frames).abs().max() > 1e-3


def test_builds_are_seeded_and_leave_the_global_rng_alone(pipe):
    state = torch.random.get_rng_state()
    again = build_tiny_ltx2()
    assert torch.equal(torch.random.get_rng_state(), state)
    for name in ("transformer", "text_encoder", "connectors", "vae", "audio_vae", "vocoder"):
        a, b = getattr(pipe, name).state_dict(), getattr(again, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        module = getattr(pipe, name)
        assert not module.training and not any(p.requires_grad for p in module.parameters()), name
    other = build_tiny_ltx2(seed=1).transformer.state_dict()
    assert not torch.equal(other["proj_out.weight"], pipe.transformer.state_dict()["proj_out.weight"])
    assert REAL_TRANSFORMER_CONFIG["num_layers"] == 48 and pipe.transformer.config.num_layers == 2


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="Ulysses"):
        TinyLTX2Config(heads=3)
    with pytest.raises(ValueError, match="base_channels"):
        TinyLTX2Config(audio_base_channels=8)
    with pytest.raises(ValueError, match="registers"):
        TinyLTX2Config(max_sequence_length=100)


def test_image_to_video_conditions_the_first_latent_frame():
    import PIL.Image
    from diffusers import LTX2ImageToVideoPipeline

    pipe = build_tiny_ltx2(image=True)
    assert isinstance(pipe, LTX2ImageToVideoPipeline)
    pixels = np.random.default_rng(0).integers(0, 256, (SIZE["height"], SIZE["width"], 3), dtype=np.uint8)
    calls: list[dict] = []
    # image_crf=0: no H.264 re-compression of the image (that needs PyAV)
    out = generate(pipe, record=calls, image=PIL.Image.fromarray(pixels), image_crf=0)
    assert out.frames.shape == VIDEO_LATENT_SHAPE and torch.isfinite(out.frames).all()
    per_frame = VIDEO_LATENT_SHAPE[3] * VIDEO_LATENT_SHAPE[4]
    timestep = calls[0]["timestep"]  # per video token: 0 on the clean first latent frame
    assert timestep.shape == (2, 3 * per_frame)
    assert not timestep[:, :per_frame].any() and (timestep[:, per_frame:] == 1000).all()
