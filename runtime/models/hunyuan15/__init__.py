"""The HunyuanVideo-1.5 family adapter (diffusers' `HunyuanVideo15Transformer3DModel`).

What the parallel strategies need of this family (runtime/strategies/parallelize.py calls
`install`); diffusers has no context-parallel plan for it:
- text: the model embeds three text streams (SigLIP image tokens, ByT5 glyph text, the Qwen
  prompt), puts the valid tokens of each first and the padding after, and masks the padding
  in every attention. With one video per forward the padding is cut at each block's entry (a
  pre-hook): masked keys add nothing and the padded rows never reach the output, so this is
  the mask's computation without the mask, and every attention runs unmasked;
- video tokens enter at `rope` (cos, sin [N, D], sequence on dim 0) and at `x_embedder`
  ([B, N, C]): both sharded to the rank's chunk, in the same row-major order. Image-to-video's
  condition latents and mask are channels of the same input ([B, 2C + 1, F, H, W] before the
  patch embedding), so they are sharded with the tokens they belong to;
- text tokens stay whole on every rank (image-to-video's 729 SigLIP tokens are valid text
  there, first in the joint text); per-sample inputs (temb) stay whole;
- joint self-attention in every block (`transformer_blocks[i].attn`), as HunyuanVideo's
  dual-stream blocks (runtime/models/hunyuan `JointAttention`: video projections, RMS norms,
  rotary on the video, then the strategy over all chunks plus the text keys; the text rows
  over every chunk, identical on every rank);
- the output is gathered at `proj_out` (video tokens only), so every rank unpatchifies the
  whole prediction.
"""

from __future__ import annotations

import contextlib

import torch

from basics.errors import ConfigError
from runtime.models.hunyuan import JointAttention, pack_boundary, valid_text_tokens, video_token_hooks
from runtime.models.hunyuan15.checkpoint import (
    COMPONENTS,
    PIPELINES,
    REQUIRED,
    TRANSFORMER_CLASS,
    VAE_CLASS,
    dir_variant,
    named_parts,
)
from runtime.models.hunyuan15.models import MODELS
from runtime.models.hunyuan15.shapes import (
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
from runtime.models.hunyuan15.vae import decode_tile, join_chunks, tiling, vae_chunks

__all__ = [
    "COMPONENTS", "FOLDER_DEFAULTS", "MODELS", "PIPELINES", "PIPELINE_DEFAULTS", "REQUIRED", "SCHEDULE_BY_SIGMAS",
    "TRANSFORMER_CLASS", "VAE_CLASS", "attention_shape", "block_params", "blocks_params", "count_params", "decode_tile",
    "dir_variant", "expert_schedule", "from_block", "fsdp_gathered_params", "install", "install_tp", "join_chunks",
    "load_model", "named_parts", "pack_boundary", "patch_size", "probes", "rope_max_seq_len", "segment_blocks",
    "shape_of", "tiling", "uninstall", "uninstall_tp", "vae_chunks", "vae_shape_of", "vae_strides",
]  # fmt: skip


def install(transformer, ctx) -> tuple[list, list]:
    """Shard `transformer`'s video tokens over `ctx`, cut the text padding and route every
    block's joint attention through the strategy; returns (hook handles, the processors
    replaced) for `uninstall`."""
    valid: dict[str, int] = {}

    def new_forward(module, args, kwargs):
        valid.clear()  # the text of this forward: counted at the first block that runs
        return args, kwargs

    def drop_text_padding(module, args):
        text, mask = args[1], args[3]
        if "n" not in valid:
            assert mask.shape[0] == 1, "one video per forward"
            valid["n"] = valid_text_tokens(mask[0])
            assert bool(mask[0, : valid["n"]].all()), "the model puts the valid text tokens first"
        return (args[0], text[:, : valid["n"]], *args[2:])

    handles = [transformer.register_forward_pre_hook(new_forward, with_kwargs=True)]
    handles += video_token_hooks(transformer, ctx)
    blocks = list(transformer.transformer_blocks)
    handles += [block.register_forward_pre_hook(drop_text_padding) for block in blocks]
    processors = [block.attn.processor for block in blocks]
    for layer, block in enumerate(blocks):
        block.attn.set_processor(JointAttention(ctx, layer))
    return handles, processors


def uninstall(transformer, handles: list, processors: list) -> None:
    for handle in handles:
        handle.remove()
    for block, processor in zip(transformer.transformer_blocks, processors, strict=True):
        block.attn.set_processor(processor)


def install_tp(transformer, tp) -> tuple[list, list]:
    """Tensor parallelism is not written for the joint text-video blocks (the layout check
    refuses it first, planner/layout.py `check_model`)."""
    raise ConfigError("--parallel tp is not supported for HunyuanVideo-1.5; use ring, ulysses or usp")


def uninstall_tp(transformer, handles: list, undo: list) -> None:
    """Nothing to undo: `install_tp` installs nothing."""
    assert not handles and not undo, "install_tp never installs on HunyuanVideo-1.5"


def attention_shape(transformer) -> tuple[int, int, int]:
    cfg = transformer.config
    return cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim


def patch_size(transformer) -> tuple[int, int, int]:
    cfg = transformer.config
    return cfg.patch_size_t, cfg.patch_size, cfg.patch_size


# -- Hybridiff's segments (runtime/guidance.py) -------------------------------------------


def segment_blocks(transformer) -> list:
    return list(transformer.transformer_blocks)


@contextlib.contextmanager
def from_block(transformer, split: int, boundary: torch.Tensor):
    """Within: the transformer runs blocks [split, L) and the head on `boundary` (video and text
    streams, the text as long as this forward's) in place of their inputs."""
    blocks = transformer.transformer_blocks

    def inject(module, args):
        text_len = args[1].shape[1]
        assert boundary.shape[1] == args[0].shape[1] + text_len, "segment A ran with another text length"
        return (boundary[:, :-text_len], boundary[:, -text_len:], *args[2:])

    handle = blocks[split].register_forward_pre_hook(inject)
    transformer.transformer_blocks = torch.nn.ModuleList(list(blocks)[split:])
    try:
        yield
    finally:
        transformer.transformer_blocks = blocks
        handle.remove()


def probes(transformer) -> list[tuple]:
    """Per block: (a module called only when the block computes, one called only when its
    attention computes): what a step cache's record counts (runtime/step_cache.py)."""
    return [(b.ff.net[2], b.attn.to_q) for b in transformer.transformer_blocks]


def load_model(components: dict, device: torch.device, max_text_len: int, variant=None):
    """The loaded checkpoint as the denoising loop drives it (runtime/models/hunyuan15/loop.py)."""
    from runtime.models.hunyuan15.loop import Hunyuan15Model

    if variant is not None and (variant.experts != 1 or variant.expand_timesteps or variant.image == "optional"):
        raise ValueError(f"HunyuanVideo-1.5 has no variant {variant}")
    return Hunyuan15Model(components, device, max_text_len, variant)
