"""The HunyuanVideo family's shapes: what the registry, the memory model and the cost model
need of its transformer and VAE."""

from __future__ import annotations

import torch

from planner.models import VaeShape
from runtime.models.protocol import config_int

VAE_ACTIVATION_FACTOR = 6.0  # as Wan's (runtime/models/wan/shapes.py), measured for this decoder
# The HunyuanVideo authors' default negative prompt (their constants.py's NEGATIVE_PROMPT). It
# matters only with real CFG (--true-cfg-scale > 1), as in their sampler.
NEGATIVE_PROMPT = (
    "Aerial view, aerial view, overexposed, low quality, deformation, a poor composition, bad hands, bad teeth, "
    "bad eyes, bad limbs, distortion"
)
# HunyuanVideoPipeline's defaults (720x1280, 129 frames, 50 steps, embedded guidance 6.0).
PIPELINE_DEFAULTS = {"guidance": 6.0, "height": 720, "width": 1280, "frames": 129, "fps": 24, "max_text_len": 256,
                     "true_cfg": 1.0, "negative_prompt": NEGATIVE_PROMPT}  # fmt: skip
SCHEDULE_BY_SIGMAS = True  # the pipeline's loop sets the sigmas (np.linspace(1, 0, steps + 1)[:-1])


def rope_max_seq_len(config: dict) -> int:
    """Patches per axis the positions may reach: the rotary angles are computed for each size,
    so no table bounds them; the bound is the one every family's checks share."""
    return 1024


def vae_strides(config: dict) -> tuple[int, int]:
    """(time, space) compression of an `AutoencoderKLHunyuanVideo` config."""
    return config_int(config, "temporal_compression_ratio", 4), config_int(config, "spatial_compression_ratio", 8)


def shape_of(name: str, config: dict, params: int, text_len: int, vae_stride: tuple[int, int, int]):
    """The model's shape from its transformer config; `layers` counts the dual- and
    single-stream blocks (every one runs a joint self-attention), `ffn` is mlp_ratio x width."""
    from planner.models import ModelShape

    heads, head_dim = int(config.get("num_attention_heads", 24)), int(config.get("attention_head_dim", 128))
    p, p_t = int(config.get("patch_size", 2)), int(config.get("patch_size_t", 1))
    return ModelShape(
        name=name,
        layers=int(config.get("num_layers", 20)) + int(config.get("num_single_layers", 40)),
        heads=heads,
        head_dim=head_dim,
        ffn=int(float(config.get("mlp_ratio", 4.0)) * heads * head_dim),
        text_len=text_len,
        params=params,
        text_dim=int(config.get("text_embed_dim", 4096)),
        latent_channels=int(config.get("out_channels") or config.get("in_channels", 16)),
        patch=(p_t, p, p),
        vae_stride=vae_stride,
        joint_text=True,
    )


def block_params(config: dict) -> int:
    """Parameters of the largest block, a dual-stream `HunyuanVideoTransformerBlock` (checked
    against the meta-device block by `tests/test_memory.py`)."""
    c = int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128))
    m = float(config.get("mlp_ratio", 4.0))
    d = int(config.get("attention_head_dim", 128))
    # per stream: 6C modulation, q/k/v + out projections, MLP; four RMS norms of the head dim
    return int(20 * c * c + 20 * c + 2 * (2 * m * c * c + (m + 1) * c)) + 4 * d


def blocks_params(config: dict) -> int:
    """All dual- and single-stream blocks together (the rest is the root: embedders, refiner, head)."""
    c = int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128))
    m, d = float(config.get("mlp_ratio", 4.0)), int(config.get("attention_head_dim", 128))
    mlp = int(m * c)
    single = c * (3 * c + mlp) + (3 * c + mlp) + (c + mlp) * c + c + 3 * c * c + 3 * c + 2 * d
    return int(config.get("num_layers", 20)) * block_params(config) + int(config.get("num_single_layers", 40)) * single


def vae_shape_of(config: dict, params: int) -> VaeShape:
    """The decoder of an `AutoencoderKLHunyuanVideo` config, as diffusers builds and runs it:
    up blocks from the widest, spatial upsampling in the first log2(spatial) of them, temporal
    in the two before the last; frame chunks of 16 sample frames (4 + 1 latent) every 12."""
    widths = [int(w) for w in config.get("block_out_channels", (128, 256, 512, 512))][::-1]
    spatial, temporal = (
        int(config.get("spatial_compression_ratio", 8)),
        int(config.get("temporal_compression_ratio", 4)),
    )
    n = len(widths)
    levels = [max(widths[max(i - 1, 0)], w) for i, w in enumerate(widths)]
    time_up = tuple(n - 1 - 2 <= i < n - 1 for i in range(n))
    return VaeShape(
        params,
        int(config.get("latent_channels", 16)),
        spatial,
        temporal,
        1,
        tuple(levels),
        (0,) * n,
        time_up,
        chunk_frames=16 // temporal + 1,
        chunk_stride=12 // temporal,
        masked_attention=True,
        causal_frames=False,
        activation_factor=VAE_ACTIVATION_FACTOR,
    )


def count_params(config: dict) -> int:
    """Parameters of a transformer with this config, built on the meta device (no memory)."""
    from diffusers import HunyuanVideoTransformer3DModel

    known = set(HunyuanVideoTransformer3DModel.extract_init_dict(config)[0])
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel(**{k: v for k, v in config.items() if k in known})
    return sum(p.numel() for p in model.parameters())


def expert_schedule(variant, timesteps: list[float], num_train_timesteps: int) -> list[int]:
    """One expert."""
    return [0] * len(timesteps)


def fsdp_gathered_params(config: dict, hidden: int, layers: int) -> int:
    """What --shard-weights gathers per forward: every block whole."""
    return blocks_params(config)
