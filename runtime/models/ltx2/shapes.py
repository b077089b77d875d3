"""The LTX-2 family's shapes: what the registry, the memory model and the cost model need of its
transformer (blocks of a video stream and an audio stream; the strategies split the video's
self-attention) and its VAE (32x in space, 8x in time).

The audio stream (25 latent frames a second, a few hundred tokens) is whole on every rank and
small beside the video: the planner's figures count the video's tokens and the blocks' whole
weights, not the audio's activations.
"""

from __future__ import annotations

import torch

from planner.models import ModelShape, VaeShape
from runtime.models.protocol import config_int

# LTX2Pipeline's __call__ defaults: 512x768, 121 frames (its fixed default without a duration
# head) at 24 fps, 30 steps, guidance 3.0, no negative prompt (""). Its other guidance terms
# are runtime/models/ltx2/loop.py's GUIDANCE.
PIPELINE_DEFAULTS = {
    "height": 512,
    "width": 768,
    "frames": 121,
    "fps": 24,
    "steps": 30,
    "guidance": 3.0,
    "negative_prompt": "",
    "max_text_len": 1024,
}
FOLDER_DEFAULTS = ()  # the pipeline reads no generation default from the checkpoint's configs
SCHEDULE_BY_SIGMAS = True  # the pipeline sets the sigmas (np.linspace(1, 1/steps, steps)) and a shift


def shape_of(name: str, config: dict, params: int, text_len: int, vae_stride: tuple[int, int, int]) -> ModelShape:
    """The video stream's shape: `num_layers` blocks, each a self-attention over the video
    tokens (what the strategies split) and a cross-attention to the connectors' text."""
    heads, head_dim = int(config.get("num_attention_heads", 32)), int(config.get("attention_head_dim", 128))
    p, p_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
    return ModelShape(
        name=name,
        layers=int(config.get("num_layers", 48)),
        heads=heads,
        head_dim=head_dim,
        ffn=4 * heads * head_dim,
        text_len=text_len,
        params=params,
        text_dim=int(config.get("caption_channels", 3840)),
        latent_channels=int(config.get("out_channels") or config.get("in_channels", 128)),
        patch=(p_t, p, p),
        vae_stride=vae_stride,
        own_guidance=True,
        guided_forwards=4 if config.get("perturbed_attn") else 3,  # runtime/models/ltx2/loop.py guided_noise
    )


def _attention_params(query: int, kv: int, inner: int, heads: int, bias: int, out_bias: int, gated: bool) -> int:
    """An `LTX2Attention`: RMS norms of q and k, q from `query`, k and v from `kv`, the output
    back to `query`, and per-head gate logits when gated."""
    return (
        2 * inner
        + (query + bias) * inner
        + 2 * (kv + bias) * inner
        + (inner + out_bias) * query
        + gated * (query + 1) * heads
    )


def block_params(config: dict) -> int:
    """Parameters of one `LTX2VideoTransformerBlock` (checked against the meta-device block by
    tests/test_ltx2.py): per stream its modulation tables, self-attention, text cross-attention
    and 4x feed-forward; the audio-to-video and video-to-audio cross-attentions (audio heads)."""
    g = config.get
    heads, audio_heads = int(g("num_attention_heads", 32)), int(g("audio_num_attention_heads", 32))
    video, audio = heads * int(g("attention_head_dim", 128)), audio_heads * int(g("audio_attention_head_dim", 64))
    bias, out_bias, ff_bias = (
        int(g("attention_bias", True)),
        int(g("attention_out_bias", True)),
        int(g("ff_bias", True)),
    )
    audio_ff_bias = int(g("audio_ff_bias", True))
    v_gate, a_gate = bool(g("gated_attn", False)), bool(g("audio_gated_attn", False))
    v_mod, a_mod = bool(g("cross_attn_mod", False)), bool(g("audio_cross_attn_mod", False))
    text, audio_text = int(g("cross_attention_dim", 4096)), int(g("audio_cross_attention_dim", 2048))
    tables = (9 if v_mod else 6) * video + (9 if a_mod else 6) * audio + 5 * (video + audio)
    tables += 2 * (video + audio) if v_mod or a_mod else 0
    attentions = (
        _attention_params(video, video, video, heads, bias, out_bias, v_gate)
        + _attention_params(audio, audio, audio, audio_heads, bias, out_bias, a_gate)
        + _attention_params(video, text, video, heads, bias, out_bias, v_gate)
        + _attention_params(audio, audio_text, audio, audio_heads, bias, out_bias, a_gate)
        + _attention_params(video, audio, audio, audio_heads, bias, out_bias, v_gate)
        + _attention_params(audio, video, audio, audio_heads, bias, out_bias, a_gate)
    )
    feed_forward = 8 * video * video + 5 * video * ff_bias + 8 * audio * audio + 5 * audio * audio_ff_bias
    return tables + attentions + feed_forward


def blocks_params(config: dict) -> int:
    """All the blocks (the rest is the root: projections, embeddings, the two heads)."""
    return int(config.get("num_layers", 48)) * block_params(config)


def fsdp_gathered_params(config: dict, hidden: int, layers: int) -> int:
    """What --shard-weights gathers per forward: every block whole."""
    return blocks_params(config)


def vae_strides(config: dict) -> tuple[int, int]:
    """(time, space) compression of an `AutoencoderKLLTX2Video` config: its own ratios where it
    sets them, else as diffusers derives them (the patch times 2 per scaling level)."""
    scaling = config.get("spatio_temporal_scaling", (True, True, True, True))
    if isinstance(scaling, bool):  # diffusers repeats one flag over the encoder's levels
        scaling = [scaling] * (len(config.get("block_out_channels", (0, 0, 0, 0))) - 1)
    levels = sum(bool(s) for s in scaling) if isinstance(scaling, (list, tuple)) else 0
    space = config_int(config, "patch_size", 4) * 2**levels
    time = config_int(config, "patch_size_t", 1) * 2**levels
    return config_int(config, "temporal_compression_ratio", time), config_int(
        config, "spatial_compression_ratio", space
    )


def rope_max_seq_len(config: dict) -> int:
    """Patches per axis the positions may reach: the rotary is computed for each position."""
    return 1024


def vae_shape_of(config: dict, params: int) -> VaeShape:
    """The decoder of an `AutoencoderKLLTX2Video` config: its levels from the widest, each up
    block doubling space and time; the whole clip in one pass (causal padding, no caches).
    `activation_factor` is HunyuanVideo's decoder's, not calibrated for this one."""
    widths = [int(w) for w in config.get("decoder_block_out_channels", (256, 512, 1024))][::-1]
    t, s = vae_strides(config)
    n = len(widths) + 1
    levels = (widths[0], *widths)
    return VaeShape(
        params,
        int(config.get("latent_channels", 128)),
        s,
        t,
        int(config.get("patch_size", 4)),
        tuple(levels),
        (0,) * n,
        tuple(i < n - 1 for i in range(n)),
        chunk_frames=1 << 20,
        chunk_stride=1 << 20,
        causal_frames=False,
        activation_factor=6.0,
    )


def _known(config: dict) -> dict:
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel

    known = set(LTX2VideoTransformer3DModel.extract_init_dict(config)[0])
    return {k: v for k, v in config.items() if k in known}


def count_params(config: dict) -> int:
    """Parameters of a transformer with this config, built on the meta device (no memory)."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**_known(config))
    return sum(p.numel() for p in model.parameters())


def expert_schedule(variant, timesteps: list[float], num_train_timesteps: int) -> list[int]:
    """One expert."""
    return [0] * len(timesteps)
