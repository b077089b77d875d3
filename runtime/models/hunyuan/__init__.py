"""The HunyuanVideo family adapter (diffusers' `HunyuanVideoTransformer3DModel`).

What the parallel strategies need of this family (runtime/strategies/parallelize.py calls
`install`); diffusers has no context-parallel plan for it:
- text padding: with one video per forward the padded text tokens are dropped before the
  model runs (a pre-hook on the transformer). Their keys are masked out and their rows never
  reach the output, so this is the mask's computation without the mask, and it leaves every
  self-attention unmasked;
- video tokens enter at `rope` (cos, sin [N, D], sequence on dim 0) and at `x_embedder`
  ([B, N, C]): both sharded to the rank's chunk (row-major frame, row, column order, the
  same in both);
- text tokens (the token refiner's output, [B, L, C]) stay whole on every rank; per-sample
  inputs (temb: timestep, embedded guidance, pooled CLIP) stay whole;
- joint self-attention in every dual-stream (`transformer_blocks`) and single-stream
  (`single_transformer_blocks`) block (`JointAttention`): video and text projections and
  RMS norms as diffusers forms them, rotary on the video only, then `ctx.joint_attention`:
  the video rows by the strategy over all chunks plus the text keys, the text rows over
  every chunk (gathered states) plus the text keys, identical on every rank;
- the output is gathered at the model's `proj_out` (video tokens only), so every rank
  unpatchifies the whole prediction.
"""

from __future__ import annotations

import contextlib

import torch

from basics.errors import ConfigError
from runtime.compile import joint_attend
from runtime.models.hunyuan.checkpoint import (
    COMPONENTS,
    PIPELINES,
    REQUIRED,
    TRANSFORMER_CLASS,
    VAE_CLASS,
    dir_variant,
    named_parts,
)
from runtime.models.hunyuan.models import MODELS
from runtime.models.hunyuan.shapes import (
    PIPELINE_DEFAULTS,
    SCHEDULE_BY_SIGMAS,
    VAE_ACTIVATION_FACTOR,
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
from runtime.models.hunyuan.vae import decode_tile, join_chunks, vae_chunks
from runtime.models.vae_tiling import diffusers_tiling as tiling
from runtime.profiling import region

__all__ = [
    "COMPONENTS", "FOLDER_DEFAULTS", "MODELS", "PIPELINE_DEFAULTS", "PIPELINES", "REQUIRED", "SCHEDULE_BY_SIGMAS",
    "TRANSFORMER_CLASS", "VAE_ACTIVATION_FACTOR", "VAE_CLASS", "attention_shape", "block_params", "blocks_params",
    "count_params", "decode_tile", "dir_variant", "expert_schedule", "from_block", "fsdp_gathered_params", "install",
    "install_tp", "join_chunks", "JointAttention", "load_model", "named_parts", "pack_boundary", "patch_size", "probes",
    "rope_max_seq_len", "segment_blocks", "shape_of", "tiling", "uninstall", "uninstall_tp", "vae_chunks",
    "vae_shape_of", "vae_strides", "valid_text_tokens", "video_token_hooks"
]  # fmt: skip

FOLDER_DEFAULTS = ()  # its pipeline reads no generation default from the checkpoint's configs


class JointAttention:
    """Processor of a HunyuanVideo block's attention under context parallelism; `layer`
    counts dual-stream blocks first, then single-stream ones (DiTango's layer index)."""

    def __init__(self, ctx, layer: int) -> None:
        self.ctx = ctx
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        assert encoder_hidden_states is not None, "HunyuanVideo blocks always attend the text"
        # The mask is all valid: drop_text_padding (installed with this processor) cut the padding
        # and checked the rest once a forward; reading it here would wait for the GPU every block.

        def heads(x):
            return x.unflatten(2, (attn.heads, -1))

        video, text = hidden_states, encoder_hidden_states
        q, k, v = heads(attn.to_q(video)), heads(attn.to_k(video)), heads(attn.to_v(video))
        if attn.add_q_proj is None:  # single-stream: one set of projections for video and text
            qt, kt, vt = heads(attn.to_q(text)), heads(attn.to_k(text)), heads(attn.to_v(text))
            norm_qt, norm_kt = attn.norm_q, attn.norm_k
        else:  # dual-stream: the text's own projections
            qt, kt, vt = heads(attn.add_q_proj(text)), heads(attn.add_k_proj(text)), heads(attn.add_v_proj(text))
            norm_qt, norm_kt = attn.norm_added_q, attn.norm_added_k
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        if norm_qt is not None:
            qt, kt = norm_qt(qt), norm_kt(kt)
        if image_rotary_emb is not None:  # positions: video tokens only (the local chunk's)
            with region("rotary"):
                q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
                k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out_v, out_t = joint_attend(self.ctx, q, k, v, qt, kt, vt, q.shape[-1] ** -0.5, self.layer)
        out_v, out_t = out_v.flatten(2, 3).to(q.dtype), out_t.flatten(2, 3).to(q.dtype)
        if getattr(attn, "to_out", None) is not None:
            out_v = attn.to_out[1](attn.to_out[0](out_v))
        if getattr(attn, "to_add_out", None) is not None:
            out_t = attn.to_add_out(out_t)
        return out_v, out_t


def _blocks(transformer) -> list:
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def valid_text_tokens(mask_L: torch.Tensor) -> int:
    """How many text tokens of a (right-padded) mask are valid: a read on the host."""
    return int(mask_L.sum().item())


def video_token_hooks(transformer, ctx) -> list:
    """The hooks that shard the video tokens where they enter (`rope`'s cos and sin [N, D],
    `x_embedder`'s [B, N, C], the same row-major order) and gather them at `proj_out`: the
    HunyuanVideo families' (their text stays whole)."""

    def shard_rope(module, args, output):
        cos, sin = output  # [N, D] float32
        ctx.begin_forward(cos.shape[0])
        return ctx.shard(cos, dim=0), ctx.shard(sin, dim=0)

    def shard_video(module, args, output):
        assert output.shape[1] == ctx.tokens, "rope and video tokens disagree on the token count"
        return ctx.shard(output)

    return [
        transformer.rope.register_forward_hook(shard_rope),
        transformer.x_embedder.register_forward_hook(shard_video),
        transformer.proj_out.register_forward_hook(lambda module, args, output: ctx.gather(output)),
    ]


def install(transformer, ctx) -> tuple[list, list]:
    """Shard `transformer`'s video tokens over `ctx` and route its joint attention through the
    strategy; returns (hook handles, the processors replaced) for `uninstall`."""
    if transformer.config.image_condition_type is not None:
        raise ValueError(
            f"HunyuanVideo image conditioning ({transformer.config.image_condition_type}) is not supported"
        )

    def drop_text_padding(module, args, kwargs):
        mask = kwargs.get("encoder_attention_mask")
        text = kwargs.get("encoder_hidden_states")
        if mask is None or text is None:
            return args, kwargs
        assert mask.shape[0] == 1, "one video per forward"
        valid = valid_text_tokens(mask[0])
        assert bool(mask[0, :valid].all()), "the valid text tokens must come first (right padding)"
        return args, {**kwargs, "encoder_hidden_states": text[:, :valid], "encoder_attention_mask": mask[:, :valid]}

    handles = [transformer.register_forward_pre_hook(drop_text_padding, with_kwargs=True)]
    handles += video_token_hooks(transformer, ctx)
    blocks = _blocks(transformer)
    processors = [block.attn.processor for block in blocks]
    for layer, block in enumerate(blocks):
        block.attn.set_processor(JointAttention(ctx, layer))
    return handles, processors


def install_tp(transformer, tp) -> tuple[list, list]:
    """Tensor parallelism is not written for the joint text-video blocks yet (the layout check
    refuses it first, planner/layout.py `check_model`)."""
    raise ConfigError("--parallel tp is not supported yet for HunyuanVideo; use ring, ulysses or usp")


def uninstall_tp(transformer, handles: list, undo: list) -> None:
    """Nothing to undo: `install_tp` installs nothing."""
    assert not handles and not undo, "install_tp never installs on HunyuanVideo"


def uninstall(transformer, handles: list, processors: list) -> None:
    for handle in handles:
        handle.remove()
    for block, processor in zip(_blocks(transformer), processors, strict=True):
        block.attn.set_processor(processor)


def attention_shape(transformer) -> tuple[int, int, int]:
    """(layers, heads, head_dim) of the joint self-attention: dual- then single-stream blocks."""
    cfg = transformer.config
    return cfg.num_layers + cfg.num_single_layers, cfg.num_attention_heads, cfg.attention_head_dim


def patch_size(transformer) -> tuple[int, int, int]:
    cfg = transformer.config
    return cfg.patch_size_t, cfg.patch_size, cfg.patch_size


# -- Hybridiff's segments (runtime/guidance.py) -------------------------------------------


def segment_blocks(transformer) -> list:
    """The blocks a two-segment pipeline cuts: dual-stream, then single-stream."""
    return _blocks(transformer)


def pack_boundary(output) -> torch.Tensor:
    """A block's output (video chunk, text stream) as one tensor [B, S + L, C]: the text
    stream evolves through the blocks, so segment B starts from segment A's."""
    video, text = output
    return torch.cat([video, text], dim=1)


@contextlib.contextmanager
def from_block(transformer, split: int, boundary: torch.Tensor):
    """Within: the transformer runs blocks [split, L) and the head on `boundary` (video and text
    streams, the text as long as this forward's) in place of their inputs."""
    dual, single = transformer.transformer_blocks, transformer.single_transformer_blocks
    first = (list(dual) + list(single))[split]

    def inject(module, args):
        text_len = args[1].shape[1]
        assert boundary.shape[1] == args[0].shape[1] + text_len, "segment A ran with another text length"
        return (boundary[:, :-text_len], boundary[:, -text_len:], *args[2:])

    handle = first.register_forward_pre_hook(inject)
    n = len(dual)
    transformer.transformer_blocks = torch.nn.ModuleList(list(dual)[split:])
    transformer.single_transformer_blocks = torch.nn.ModuleList(list(single)[max(0, split - n) :])
    try:
        yield
    finally:
        transformer.transformer_blocks, transformer.single_transformer_blocks = dual, single
        handle.remove()


def probes(transformer) -> list[tuple]:
    """Per block: (a module called only when the block computes, one called only when its
    attention computes): what a step cache's record counts (runtime/step_cache.py)."""
    return [(b.ff.net[2] if hasattr(b, "ff") else b.proj_mlp, b.attn.to_q) for b in _blocks(transformer)]


def load_model(components: dict, device: torch.device, max_text_len: int, variant=None, prompt_template=None):
    """`variant`: a registry spec's (HunyuanVideo has one expert, no per-token timesteps, no
    image: only the default is accepted); `prompt_template`: the Llama template (None: diffusers')."""
    from runtime.models.hunyuan.loop import HunyuanModel

    if variant is not None and (variant.experts != 1 or variant.expand_timesteps or variant.image != "none"):
        raise ValueError(f"HunyuanVideo has no variant {variant}")
    return HunyuanModel(components, device, max_text_len, prompt_template)
