"""The Wan family adapter: Wan2.1 and Wan2.2 as diffusers runs them (`WanTransformer3DModel`).

What the parallel strategies need of this family, declared in one place (the strategies
name no model; runtime/strategies/parallelize.py calls `install`):
- tokens enter at `rope` (cos, sin [1, S, 1, D], sharded to the rank's chunk) and at
  `blocks[0]` (hidden states [B, S, C], sharded);
- per-token inputs: with `expand_timesteps` (Wan2.2 TI2V) the `condition_embedder` returns
  per-token time embeddings temb [B, S, C] and timestep_proj [B, S, 6C]: sharded with the
  tokens (per-sample ones [B, C] stay whole);
- self-attention is `blocks[i].attn1`: q/k/v projections, RMS norm across heads, Wan's
  interleaved rotary (`WanSelfAttention` below), then the strategy's attention over all
  chunks; cross-attention (`attn2`, text and image keys) keeps diffusers' processor;
- the output is gathered at `proj_out` [B, S_local, C], so every rank unpatchifies the whole
  prediction;
- the model's shape (`shape_of`) for the registry, `check` and the cost model.
Everything else in a Wan block is per token and runs unchanged on the local chunk.
Tensor parallelism (`install_tp`) shards no tokens: it names the projections split
column- and row-wise and the RMS norms across heads, and leaves the rest whole.

Variants (`WanVariant`, from model_index.json): one or two experts switched at
`boundary_ratio * num_train_timesteps` (Wan2.2 A14B), per-token timesteps (`expand_timesteps`,
TI2V-5B), and image-to-video through `WanImageToVideoPipeline` (Wan2.1 I2V with a CLIP image
encoder; Wan2.2 I2V with the image only in the latents).
"""

from __future__ import annotations

import contextlib

import torch

from runtime.compile import attend
from runtime.models.vae_tiling import diffusers_tiling as tiling
from runtime.models.wan.checkpoint import (
    COMPONENTS,
    IMAGE_ENCODER_CLASSES,
    IMAGE_PROCESSOR_CLASSES,
    PIPELINES,
    REQUIRED,
    TRANSFORMER_CLASS,
    VAE_CLASS,
    dir_variant,
    named_parts,
)
from runtime.models.wan.models import MODELS
from runtime.models.wan.shapes import (
    PIPELINE_DEFAULTS,
    SCHEDULE_BY_SIGMAS,
    VAE_ACTIVATION_FACTOR,
    WanVariant,
    block_params,
    blocks_params,
    count_params,
    expert_schedule,
    fsdp_gathered_params,
    rope_max_seq_len,
    same_architecture,
    shape_of,
    vae_shape_of,
    vae_strides,
)
from runtime.models.wan.vae import decode_tile, join_chunks, vae_chunks
from runtime.profiling import region

__all__ = [
    "COMPONENTS", "FOLDER_DEFAULTS", "IMAGE_ENCODER_CLASSES", "IMAGE_PROCESSOR_CLASSES", "MODELS", "PIPELINE_DEFAULTS",
    "PIPELINES", "REQUIRED", "SCHEDULE_BY_SIGMAS", "TRANSFORMER_CLASS", "VAE_ACTIVATION_FACTOR", "VAE_CLASS",
    "apply_rotary", "attention_shape", "block_params", "blocks_params", "count_params", "decode_tile", "dir_variant",
    "expert_schedule", "from_block", "fsdp_gathered_params", "install", "install_tp", "join_chunks", "load_model",
    "named_parts", "pack_boundary", "patch_size", "probes", "rope_max_seq_len", "same_architecture", "segment_blocks",
    "shape_of", "tiling", "uninstall", "uninstall_tp", "vae_chunks", "vae_shape_of", "vae_strides", "WanSelfAttention",
    "WanVariant"
]  # fmt: skip

FOLDER_DEFAULTS = ()  # its pipeline reads no generation default from the checkpoint's configs


def load_model(components: dict, device: torch.device, max_text_len: int, variant: WanVariant | None = None):
    """The loaded checkpoint as the denoising loop drives it (runtime/models/wan/loop.py)."""
    from runtime.models.wan.loop import WanModel

    return WanModel(components, device, max_text_len, variant)


# -- parallel installation ---------------------------------------------------------------


def apply_rotary(x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the position angles; Wan's convention.

    cos/sin [1, S, 1, D] hold each angle twice (interleaved), so even lanes carry it.
    Computed in the frequency dtype, then cast back.
    """
    x_even, x_odd = x_BSHD.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    rotated = torch.stack([x_even * c - x_odd * s, x_even * s + x_odd * c], dim=-1).flatten(-2)
    return rotated.to(x_BSHD.dtype)


class WanSelfAttention:
    """Self-attention processor of a Wan block: projections, QK norm and rotary on the local
    chunk, then `ctx.attention` (the strategy) over all chunks."""

    def __init__(self, ctx, layer: int) -> None:
        self.ctx = ctx
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        assert encoder_hidden_states is None and attention_mask is None, "installed on self-attention only"
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)  # per token (RMS across heads): shard-safe
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            with region("rotary"):
                query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        out = attend(self.ctx, query, key, value, query.shape[-1] ** -0.5, self.layer)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer, ctx) -> tuple[list, list]:
    """Shard `transformer`'s tokens over `ctx` (a ShardContext) and route its self-attention
    through the strategy; returns (hook handles, the processors replaced) for `uninstall`."""

    def shard_rope(module, args, output):
        cos, sin = output  # [1, S_full, 1, D], float64 in diffusers' Wan rope
        ctx.begin_forward(cos.shape[1])
        # float32 once per forward here, rather than q and k promoted to float64 in every layer
        # (float64 is slow on GPUs; the angles' float32 rounding is far below bf16's).
        return ctx.shard(cos).float(), ctx.shard(sin).float()

    def shard_hidden(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        assert hidden.shape[1] == ctx.tokens, "rope and hidden states disagree on the token count"
        if args:
            return (ctx.shard(hidden), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": ctx.shard(hidden)}

    def shard_time(module, args, output):
        temb, timestep_proj, text, image = output
        if temb.ndim == 3:  # per-token time embeddings [B, S, C] (expand_timesteps)
            assert temb.shape[1] == ctx.tokens, "per-token timesteps and tokens disagree"
            temb, timestep_proj = ctx.shard(temb), ctx.shard(timestep_proj)
        return temb, timestep_proj, text, image

    handles = [
        transformer.rope.register_forward_hook(shard_rope),
        transformer.condition_embedder.register_forward_hook(shard_time),
        transformer.blocks[0].register_forward_pre_hook(shard_hidden, with_kwargs=True),
        transformer.proj_out.register_forward_hook(lambda module, args, output: ctx.gather(output)),
    ]
    processors = [block.attn1.processor for block in transformer.blocks]
    for layer, block in enumerate(transformer.blocks):
        block.attn1.set_processor(WanSelfAttention(ctx, layer))
    return handles, processors


def uninstall(transformer, handles: list, processors: list) -> None:
    for handle in handles:
        handle.remove()
    for block, processor in zip(transformer.blocks, processors, strict=True):
        block.attn1.set_processor(processor)


def install_tp(transformer, tp) -> tuple[list, list]:
    """Split every block's heads and FFN width over `tp` (runtime/strategies/tensor.py's
    `TensorParallel`); returns (hook handles, undo steps) for `uninstall_tp`.

    In `attn1` and `attn2`: to_q/to_k/to_v (and I2V's add_k_proj/add_v_proj) column-wise,
    the RMS norms across heads (norm_q, norm_k, norm_added_k) over the local channels,
    `heads` the local count, to_out.0 row-wise; in the FFN `net.0.proj` column-wise and
    `net.2` row-wise. attn1 runs `WanSelfAttention` on the local heads (tp's attention),
    attn2 diffusers' processor. Patch embedding, condition embedder, block norms, modulation
    tables and proj_out stay whole: every rank computes them on every token. Rotary tables
    are cast to float32 once per forward, as under the other strategies.
    """
    cfg = transformer.config
    heads = tp.local(cfg.num_attention_heads, "attention heads")
    tp.local(cfg.ffn_dim, "FFN width")
    handles = [transformer.rope.register_forward_hook(lambda module, args, out: tuple(t.float() for t in out))]
    undo = []
    for layer, block in enumerate(transformer.blocks):
        for attn in (block.attn1, block.attn2):
            assert not getattr(attn, "fused_projections", False), "tp splits unfused projections only"
            for name in ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"):
                if getattr(attn, name, None) is not None:
                    undo.append(tp.colwise(attn, name))
            for name in ("norm_q", "norm_k", "norm_added_k"):
                if isinstance(getattr(attn, name, None), torch.nn.RMSNorm):
                    undo.append(tp.norm(attn, name))
            undo.append(tp.rowwise(attn.to_out, "0"))
            undo.append(tp.set(attn, "heads", heads))
        undo.append(tp.colwise(block.ffn.net[0], "proj"))
        undo.append(tp.rowwise(block.ffn.net, "2"))
        undo.append(_set_processor(block.attn1, WanSelfAttention(tp, layer)))
    return handles, undo


def _set_processor(attn, processor):
    old = attn.processor
    attn.set_processor(processor)
    return lambda: attn.set_processor(old)


def uninstall_tp(transformer, handles: list, undo: list) -> None:
    """Undo `install_tp` (gathers the split weights: every rank of the group calls it)."""
    for handle in handles:
        handle.remove()
    for step in reversed(undo):
        step()


def attention_shape(transformer) -> tuple[int, int, int]:
    """(layers, heads, head_dim) of the self-attention the strategy runs."""
    cfg = transformer.config
    return cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim


def patch_size(transformer) -> tuple[int, int, int]:
    return tuple(transformer.config.patch_size)


# -- Hybridiff's segments (runtime/guidance.py) -------------------------------------------


def segment_blocks(transformer) -> list:
    """The blocks a two-segment pipeline cuts, in order."""
    return list(transformer.blocks)


def pack_boundary(output) -> torch.Tensor:
    """Segment A's output at the cut (a block's output) as one tensor to send."""
    return output


@contextlib.contextmanager
def from_block(transformer, split: int, boundary: torch.Tensor):
    """Within: the transformer runs blocks [split, L) and the head, on `boundary` in place of
    the (unused) patch-embedded input of the first of them."""
    blocks = transformer.blocks
    handle = blocks[split].register_forward_pre_hook(lambda module, args: (boundary, *args[1:]))
    transformer.blocks = torch.nn.ModuleList(list(blocks)[split:])
    try:
        yield
    finally:
        transformer.blocks = blocks
        handle.remove()


def probes(transformer) -> list[tuple]:
    """Per block: (a module called only when the block computes, one called only when its
    self-attention computes): what a step cache's record counts (runtime/step_cache.py). The
    FFN's output projection, not the FFN: a cache that replaces the FFN's forward still lets
    the FFN module's own hooks run."""
    return [(block.ffn.net[2], block.attn1.to_q) for block in transformer.blocks]
