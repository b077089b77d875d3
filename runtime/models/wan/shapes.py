"""The Wan family's shapes: what a checkpoint asks of the loop (`WanVariant`) and what the
registry, the memory model and the cost model need of its transformer and VAE."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.models import ModelShape, VaeShape
from runtime.models.protocol import Variant, config_int

# The decoder's live tensors at its widest resolution per (channels x frames x area): a residual
# block's input, normed and activated copies, padded convolution inputs and outputs; measured
# on CPU (benchmarks/memory.py states the error).
VAE_ACTIVATION_FACTOR = 8.0
# The Wan authors' default negative prompt (their shared config's `sample_neg_prompt`), which
# their generate.py uses when none is given; diffusers' WanPipeline leaves it empty.
NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，"
    "杂乱的背景，三条腿，背景人很多，倒着走"
)
# WanPipeline's defaults are the registry's `Defaults`; the negative prompt is the authors'.
PIPELINE_DEFAULTS: dict = {"negative_prompt": NEGATIVE_PROMPT}
SCHEDULE_BY_SIGMAS = False  # the loop sets the number of steps: every solver of schedulers.py applies


@dataclass(frozen=True)
class WanVariant(Variant):
    """A Wan checkpoint's variant: WanPipeline unless it says otherwise; whether it takes an
    image follows from its pipeline (`WanImageToVideoPipeline`: required) and per-token
    timesteps (TI2V: optional)."""

    pipeline: str = "WanPipeline"
    image: str = ""  # "": from the pipeline, as above

    def __post_init__(self) -> None:
        if not self.image:
            required = self.pipeline == "WanImageToVideoPipeline"
            image = "required" if required else "optional" if self.expand_timesteps else "none"
            object.__setattr__(self, "image", image)


def rope_max_seq_len(config: dict) -> int:
    """Patches per axis the rotary table covers (`WanRotaryPosEmbed` slices it without a check)."""
    return int(config.get("rope_max_seq_len", 1024))


def vae_strides(config: dict) -> tuple[int, int]:
    """(time, space) compression of an `AutoencoderKLWan` config, as WanPipeline sizes its latents."""
    return config_int(config, "scale_factor_temporal", 4), config_int(config, "scale_factor_spatial", 8)


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
        params,
        z,
        int(config.get("scale_factor_spatial", 8)),
        int(config.get("scale_factor_temporal", 4)),
        patch,
        tuple(widths),
        tuple(cached),
        tuple(grows),
        activation_factor=VAE_ACTIVATION_FACTOR,
    )


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


def expert_schedule(variant: WanVariant, timesteps: list[float], num_train_timesteps: int) -> list[int]:
    """Per step, 0 for `transformer`, 1 for `transformer_2` (below boundary_ratio x the training
    timesteps), as diffusers' Wan pipelines choose."""
    ratio = variant.boundary_ratio
    if ratio is None:
        return [0] * len(timesteps)
    return [0 if t >= ratio * num_train_timesteps else 1 for t in timesteps]


def blocks_params(config: dict) -> int:
    """Parameters of all the transformer's blocks (what --shard-weights shards)."""
    return int(config.get("num_layers", 40)) * block_params(config)


def fsdp_gathered_params(config: dict, hidden: int, layers: int) -> int:
    """What --shard-weights gathers per forward: the blocks less their float32 norm2 and
    modulation table (8 C a block), which FSDP keeps whole."""
    return blocks_params(config) - 8 * hidden * layers
