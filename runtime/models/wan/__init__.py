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
from dataclasses import dataclass

import torch

from planner.models import ModelShape, VaeShape

PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
TRANSFORMER_CLASS = "WanTransformer3DModel"
VAE_CLASS = "AutoencoderKLWan"
# The pipeline reads the encoder's penultimate hidden states: both CLIP vision classes give them.
IMAGE_ENCODER_CLASSES = ("CLIPVisionModel", "CLIPVisionModelWithProjection")
# transformers 5 saves its PIL fallback's name where torchvision is missing.
IMAGE_PROCESSOR_CLASSES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")


@dataclass(frozen=True)
class WanVariant:
    """What a Wan checkpoint asks of the denoising loop beyond Wan2.1 text-to-video."""

    pipeline: str = "WanPipeline"  # the diffusers pipeline that is the exact reference
    boundary_ratio: float | None = None  # two experts: `transformer` at t >= ratio * T, then `transformer_2`
    expand_timesteps: bool = False  # per-token timesteps (Wan2.2 TI2V-5B)
    image_encoder: bool = False  # CLIP image embeddings in the cross-attention (Wan2.1 I2V)

    @property
    def experts(self) -> int:
        return 1 if self.boundary_ratio is None else 2

    @property
    def image(self) -> str:
        """'required' (an image-to-video checkpoint), 'optional' (TI2V: text or image to video)
        or 'none' (text-to-video only)."""
        if self.pipeline == "WanImageToVideoPipeline":
            return "required"
        return "optional" if self.expand_timesteps else "none"

    @property
    def task(self) -> str:
        return {"required": "i2v", "optional": "ti2v", "none": "t2v"}[self.image]

    def image_pipeline(self) -> bool:
        """Whether an item with an image runs through `WanImageToVideoPipeline`."""
        return self.image != "none"


def shape_of(name: str, config: dict, params: int, text_len: int, vae_stride: tuple[int, int, int]) -> ModelShape:
    """The model's shape from its transformer config (diffusers' `config.json` keys)."""
    patch = tuple(int(p) for p in config.get("patch_size", (1, 2, 2)))
    out_channels = config.get("out_channels") or config.get("in_channels", 16)
    return ModelShape(
        name=name,
        layers=int(config.get("num_layers", 0)),
        heads=int(config.get("num_attention_heads", 0)),
        head_dim=int(config.get("attention_head_dim", 0)),
        ffn=int(config.get("ffn_dim", 0)),
        text_len=text_len,
        params=params,
        text_dim=int(config.get("text_dim", 4096)),
        latent_channels=int(out_channels),
        patch=patch,  # type: ignore[arg-type]
        vae_stride=vae_stride,
    )


def block_params(config: dict) -> int:
    """Parameters of one `WanTransformerBlock` (diffusers' layers, biases and norms included;
    `tests/test_memory.py` checks it against the meta-device block)."""
    c = int(config.get("num_attention_heads", 0)) * int(config.get("attention_head_dim", 0))
    f = int(config.get("ffn_dim", 0))
    # two attentions (q, k, v, out with biases; q/k RMS norms), FFN up/down, norm2 affine,
    # the 6C modulation table
    n = 8 * c * c + 2 * c * f + 21 * c + f
    added = config.get("added_kv_proj_dim")
    if added:  # I2V: the image's own k/v projections and k norm in the cross-attention
        n += 2 * (int(added) * c + c) + c
    return n


def vae_shape_of(config: dict, params: int) -> VaeShape:
    """The decoder's resolutions, widths and causal caches from an `AutoencoderKLWan` config,
    following the layers diffusers' `WanDecoder3d` builds from it."""
    base = int(config.get("decoder_base_dim") or config.get("base_dim", 96))
    mult = [int(m) for m in config.get("dim_mult", [1, 2, 4, 4])]
    res_blocks = int(config.get("num_res_blocks", 2))
    residual = bool(config.get("is_residual", False))
    time_up = list(config.get("temperal_downsample", [False, True, True]))[::-1]
    z = int(config.get("z_dim", 16))
    dims = [base * m for m in [mult[-1], *mult[::-1]]]
    n = len(mult)
    widths, cached, grows = [0] * n, [0] * n, [False] * n
    widths[0] = dims[0]
    cached[0] = z + 4 * dims[0]  # conv_in, then the mid block's two residual blocks
    for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if i > 0 and not residual:
            c_in //= 2  # Wan2.1's resample halves the channels it passes on
        widths[i] = max(widths[i], c_in, c_out)
        cached[i] += c_in + c_out + 2 * res_blocks * c_out  # res_blocks + 1 residual blocks, two convs each
        if i != n - 1 and time_up[i]:
            cached[i] += c_out  # the temporal upsampler's causal conv
            grows[i] = True
    cached[-1] += dims[-1]  # conv_out
    patch = int(config.get("patch_size") or 1)
    return VaeShape(
        "wan", params, z, int(config.get("scale_factor_spatial", 8)), int(config.get("scale_factor_temporal", 4)),
        patch, tuple(widths), tuple(cached), tuple(grows),
    )  # fmt: skip


def count_params(config: dict) -> int:
    """Parameters of a transformer with this config, built on the meta device (no memory)."""
    from diffusers import WanTransformer3DModel

    known = set(WanTransformer3DModel.extract_init_dict(config)[0])
    with torch.device("meta"):
        model = WanTransformer3DModel(**{k: v for k, v in config.items() if k in known})
    return sum(p.numel() for p in model.parameters())


def same_architecture(a: dict, b: dict) -> list[str]:
    """Config keys on which two experts differ (one parallel runtime serves both: the
    attention's heads, head dim and layer count must agree, and so must the token geometry)."""
    keys = ("num_layers", "num_attention_heads", "attention_head_dim", "patch_size", "in_channels", "out_channels")
    return [k for k in keys if a.get(k) != b.get(k)]


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
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        out = self.ctx.attention(query, key, value, scale=query.shape[-1] ** -0.5, layer=self.layer)
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


# -- the loop and the VAE (runtime/denoiser.py, runtime/vae.py) -------------------------------
def load_model(components: dict, device: torch.device, max_text_len: int, variant: WanVariant | None = None):
    from runtime.models.wan.loop import WanModel

    return WanModel(components, device, max_text_len, variant)


def vae_chunks(vae, frames: int) -> list[slice]:
    """Wan decodes every latent frame in one pass through its causal caches."""
    return [slice(0, frames)]


def decode_tile(vae, z_BCFHW: torch.Tensor) -> torch.Tensor:
    """The decoder's output for one tile, frame by frame through the causal caches as
    `AutoencoderKLWan.tiled_decode` does (before blending, unpatchify and clamp)."""
    vae.clear_cache()
    out = []
    for k in range(z_BCFHW.shape[2]):
        vae._conv_idx = [0]
        x = vae.post_quant_conv(z_BCFHW[:, :, k : k + 1])
        out.append(vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
    vae.clear_cache()
    return torch.cat(out, dim=2)


def join_chunks(vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor:
    """The video [B, C, F, H, W] from the blended chunks: unpatchified (Wan2.2's VAE) and clamped."""
    video = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
    patch = vae.config.patch_size
    if patch is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        video = unpatchify(video, patch_size=patch)
    return torch.clamp(video, min=-1.0, max=1.0)
