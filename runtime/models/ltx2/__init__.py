"""The LTX-2 family adapter (diffusers' `LTX2VideoTransformer3DModel`): video and audio denoised
together, each block a video stream and an audio stream joined by cross-attention both ways.

What the parallel strategies need of this family (runtime/strategies/parallelize.py calls
`install`); diffusers has no context-parallel plan for it:
- video tokens enter at `rope` and `cross_attn_rope` (cos, sin: [B, N, D] interleaved, or
  [B, heads, N, D] split) and at `proj_in` ([B, N, C]): all sharded to the rank's chunk, in the
  same frame, row, column order; so are per-token timestep embeddings (image-to-video's, 0 on
  the image's frame); the output is gathered at `proj_out`, so every rank holds the whole
  prediction;
- audio tokens (a few hundred: 25 latent frames a second) stay whole on every rank, and every
  rank computes the audio stream identically: its self-attention, its text cross-attention, its
  feed-forward;
- the video's self-attention (`attn1`) runs by the strategy over all chunks (`VideoAttention`),
  with the spatio-temporal guidance's skip (the value in place of the attention) kept;
- audio-to-video cross-attention (video queries, audio keys) and the video's text cross-attention
  need nothing: the queries are the chunk's, the keys whole;
- video-to-audio cross-attention (audio queries, video keys) is the audio rows over every chunk
  (`AudioFromVideo`): each rank's state over its own chunk, gathered and merged, identical on
  every rank.
"""

from __future__ import annotations

import torch

from basics.errors import ConfigError
from runtime.models.ltx2.checkpoint import (
    COMPONENTS,
    PIPELINES,
    REQUIRED,
    TRANSFORMER_CLASS,
    VAE_CLASS,
    dir_variant,
    named_parts,
)
from runtime.models.ltx2.models import MODELS
from runtime.models.ltx2.shapes import (
    FOLDER_DEFAULTS,
    PIPELINE_DEFAULTS,
    SCHEDULE_BY_SIGMAS,
    block_params,
    blocks_params,
    count_params,
    expert_schedule,
    fsdp_gathered_params,
    rope_max_seq_len,
    shape_of,
    vae_shape_of,
    vae_strides,
)
from runtime.models.ltx2.vae import decode_tile, join_chunks, tiling, vae_chunks

__all__ = [
    "COMPONENTS", "FOLDER_DEFAULTS", "MODELS", "PIPELINES", "PIPELINE_DEFAULTS", "REQUIRED", "SCHEDULE_BY_SIGMAS",
    "TRANSFORMER_CLASS", "VAE_CLASS", "attention_shape", "block_params", "blocks_params", "count_params", "decode_tile",
    "dir_variant", "expert_schedule", "from_block", "fsdp_gathered_params", "install", "install_tp", "join_chunks",
    "load_model", "named_parts", "pack_boundary", "patch_size", "probes", "rope_max_seq_len", "segment_blocks",
    "shape_of", "tiling", "uninstall", "uninstall_tp", "vae_chunks", "vae_shape_of", "vae_strides",
]  # fmt: skip


# `ditango rehearse` (ditango_cli/rehearse.py reads this): the rank program reaches the decode,
# then the process aborts on exit (heap corruption, not found yet); the float64 rotary tables
# (`rope_double_precision`) and the video-to-audio gathers (not in planner/traffic.py) are
# reported as problems too.
NOT_REHEARSED = "its rehearsal aborts on exit (not yet found why); run `ditango simulate` for its figures"


def __getattr__(name: str):
    """`CLASSES` (read lazily: it imports diffusers): the components a checkpoint names from
    diffusers' pipeline package `ltx2` (model_index.json's library "ltx2"), not diffusers' root."""
    if name != "CLASSES":
        raise AttributeError(name)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    return {c.__name__: c for c in (LTX2TextConnectors, LTX2Vocoder, LTX2VocoderWithBWE)}


def _rotate(attn, x: torch.Tensor, rotary) -> torch.Tensor:
    """`x` [B, S, heads x D] with the rotary `attn` uses (diffusers' own functions)."""
    from diffusers.models.transformers.transformer_ltx2 import (
        apply_interleaved_rotary_emb,
        apply_split_rotary_emb,
    )

    if rotary is None:
        return x
    rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return rotate(x, rotary)


def _finish(attn, hidden: torch.Tensor, gate_from: torch.Tensor) -> torch.Tensor:
    """The per-head gates (gated attention) and the output projection, as diffusers applies them."""
    if attn.to_gate_logits is not None:
        gates = 2.0 * torch.sigmoid(attn.to_gate_logits(gate_from))  # [B, S, heads]
        hidden = (hidden.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
    return attn.to_out[1](attn.to_out[0](hidden))


class VideoAttention:
    """Processor of a block's video self-attention under context parallelism: the chunk's queries
    over every chunk's keys by the strategy. Under spatio-temporal guidance the block's attention
    is skipped: its output is the value projection (`perturbation_mask` 0), as diffusers'
    `LTX2PerturbedAttnProcessor` does."""

    def __init__(self, ctx, layer: int) -> None:
        self.ctx = ctx
        self.layer = layer

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ):
        assert encoder_hidden_states is None and attention_mask is None, "the video self-attention is unmasked"
        value = attn.to_v(hidden_states)
        if perturbation_mask is not None and bool(all_perturbed):  # the same on every rank: no collective skipped
            return _finish(attn, value, hidden_states)
        q = _rotate(attn, attn.norm_q(attn.to_q(hidden_states)), query_rotary_emb)
        k = _rotate(attn, attn.norm_k(attn.to_k(hidden_states)), key_rotary_emb or query_rotary_emb)
        out = self.ctx.attention(_heads(attn, q), _heads(attn, k), _heads(attn, value), _scale(attn, q), self.layer)
        out = out.flatten(2, 3).to(q.dtype)
        if perturbation_mask is not None:
            out = torch.lerp(value, out, perturbation_mask)
        return _finish(attn, out, hidden_states)


class AudioFromVideo:
    """Processor of a block's video-to-audio cross-attention: the whole audio's queries over the
    video keys of every chunk (`ShardContext.whole_query_attention`)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
    ):
        assert encoder_hidden_states is not None and attention_mask is None, "audio queries over the video keys"
        q = _rotate(attn, attn.norm_q(attn.to_q(hidden_states)), query_rotary_emb)
        k = _rotate(attn, attn.norm_k(attn.to_k(encoder_hidden_states)), key_rotary_emb)
        v = attn.to_v(encoder_hidden_states)
        out = self.ctx.whole_query_attention(_heads(attn, q), _heads(attn, k), _heads(attn, v), _scale(attn, q))
        return _finish(attn, out.flatten(2, 3).to(q.dtype), hidden_states)


def _heads(attn, x: torch.Tensor) -> torch.Tensor:
    """[B, S, heads x D] -> [B, S, heads, D]."""
    return x.unflatten(2, (attn.heads, -1))


def _scale(attn, q: torch.Tensor) -> float:
    """SDPA's default: one over the square root of the head width (`q`: [B, S, heads x D])."""
    return (q.shape[-1] // attn.heads) ** -0.5


def install(transformer, ctx) -> tuple[list, list]:
    """Shard `transformer`'s video tokens over `ctx` and route the attentions that see them;
    returns (hook handles, the processors replaced) for `uninstall`."""
    dim = 1 if transformer.config.rope_type == "interleaved" else 2  # the token axis of cos and sin

    def shard_rope(module, args, output):
        cos, sin = output
        ctx.begin_forward(cos.shape[dim])
        return ctx.shard(cos, dim=dim), ctx.shard(sin, dim=dim)

    def shard_cross_rope(module, args, output):
        cos, sin = output
        assert cos.shape[dim] == ctx.tokens, "the cross-attention rotary and the video disagree on the tokens"
        return ctx.shard(cos, dim=dim), ctx.shard(sin, dim=dim)

    def shard_video(module, args, output):
        assert output.shape[1] == ctx.tokens, "rope and video tokens disagree on the token count"
        return ctx.shard(output)

    def shard_per_token(module, args, output):
        """A timestep embedding's rows: one per batch entry (a step's one timestep) stay whole;
        one per video token (image-to-video: 0 on the image's frame) go as the tokens go."""
        rows = output[0].shape[0]
        if rows < ctx.tokens or rows % ctx.tokens:
            return output
        return tuple(ctx.shard(x.unflatten(0, (-1, ctx.tokens))).flatten(0, 1) for x in output)

    handles = [
        transformer.rope.register_forward_hook(shard_rope),
        transformer.cross_attn_rope.register_forward_hook(shard_cross_rope),
        transformer.proj_in.register_forward_hook(shard_video),
        transformer.time_embed.register_forward_hook(shard_per_token),
        transformer.av_cross_attn_video_scale_shift.register_forward_hook(shard_per_token),
        transformer.av_cross_attn_video_a2v_gate.register_forward_hook(shard_per_token),
        transformer.proj_out.register_forward_hook(lambda module, args, output: ctx.gather(output)),
    ]
    replaced = []
    for layer, block in enumerate(transformer.transformer_blocks):
        replaced.append((block.attn1.processor, block.video_to_audio_attn.processor))
        block.attn1.set_processor(VideoAttention(ctx, layer))
        block.video_to_audio_attn.set_processor(AudioFromVideo(ctx))
    return handles, replaced


def uninstall(transformer, handles: list, replaced: list) -> None:
    for handle in handles:
        handle.remove()
    for block, (video, audio) in zip(transformer.transformer_blocks, replaced, strict=True):
        block.attn1.set_processor(video)
        block.video_to_audio_attn.set_processor(audio)


def install_tp(transformer, tp) -> tuple[list, list]:
    """Tensor parallelism is not written for the audio-video blocks (ditango_cli refuses it first)."""
    raise ConfigError("--parallel tp is not supported for LTX-2; use ring, ulysses or usp")


def uninstall_tp(transformer, handles: list, undo: list) -> None:
    """Nothing to undo: `install_tp` installs nothing."""
    assert not handles and not undo, "install_tp never installs on LTX-2"


def attention_shape(transformer) -> tuple[int, int, int]:
    """(layers, heads, head_dim) of the video self-attention, the one the strategies split."""
    cfg = transformer.config
    return cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim


def patch_size(transformer) -> tuple[int, int, int]:
    cfg = transformer.config
    return cfg.patch_size_t, cfg.patch_size, cfg.patch_size


# -- what CFG-parallel, Hybridiff and the step caches would ask (refused for this family) ----


def segment_blocks(transformer) -> list:
    return list(transformer.transformer_blocks)


def pack_boundary(output) -> torch.Tensor:
    raise ConfigError("--hybrid does not apply to LTX-2 (its guidance runs up to four forwards a step)")


def from_block(transformer, split: int, boundary: torch.Tensor):
    raise ConfigError("--hybrid does not apply to LTX-2 (its guidance runs up to four forwards a step)")


def probes(transformer) -> list[tuple]:
    """Per block: (a module called only when the block computes, one called only when its video
    attention computes)."""
    return [(b.ff.net[2], b.attn1.to_q) for b in transformer.transformer_blocks]


def load_model(components: dict, device: torch.device, max_text_len: int, variant=None):
    """The loaded checkpoint as the denoising loop drives it (runtime/models/ltx2/loop.py)."""
    from runtime.models.ltx2.loop import LTX2Model

    if variant is not None and (variant.experts != 1 or variant.expand_timesteps or variant.image == "required"):
        raise ValueError(f"LTX-2 has no variant {variant}")
    return LTX2Model(components, device, max_text_len)
