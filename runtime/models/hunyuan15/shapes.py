"""The HunyuanVideo-1.5 family's shapes: what the registry, the memory model and the cost model
need of its transformer (54 dual-stream blocks of joint text-video attention) and its VAE
(16x in space, 4x in time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from basics.errors import ConfigError
from planner.models import ModelShape, VaeShape
from runtime.errors import ModelDirError
from runtime.models.protocol import FolderDefault, config_int

# HunyuanVideo15Pipeline's defaults: 121 frames at 24 fps (five seconds), 50 steps; the
# guidance scale is its guider's (guider/guider_config.json), the size its transformer's
# target size implies (`default_size`): both read from the folder.
PIPELINE_DEFAULTS = {"frames": 121, "fps": 24, "max_text_len": 1000, "negative_prompt": "", "guidance": 6.0}
# HunyuanVideo15Pipeline.default_aspect_ratio (width 16 : height 9), as (height, width).
DEFAULT_ASPECT = (9, 16)


@dataclass(frozen=True)
class ImageSizes:
    """The size the pipelines pick for an aspect ratio: of the buckets of about
    (target_size / stride)^2 latent pixels (stride: the VAE's spatial compression), the one
    closest to it (their video processor's `calculate_default_height_width`). Called with an
    image's (height, width): HunyuanVideo15ImageToVideoPipeline's size for that image, which
    an image-to-video item takes when it gives neither height nor width (runtime/items.py)."""

    target_size: int
    stride: int

    def __call__(self, height: int, width: int) -> tuple[int, int]:
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.stride)
        h, w = processor.calculate_default_height_width(height, width, self.target_size)
        return int(h), int(w)


def default_size(target_size: int, folder: Path) -> dict:
    """{height, width} HunyuanVideo15Pipeline runs without them: the bucket closest to 16:9
    (`ImageSizes`, with the VAE's stride from the folder's vae/config.json); for an image-to-
    video folder also `size_of_image`, the size its pipeline picks for each image. {} where the
    target size makes no bucket."""
    from basics.user_files import read_json_file

    file = folder / "vae" / "config.json"
    try:
        vae = read_json_file(file, "model file") if file.is_file() else {}
        s = config_int(vae if isinstance(vae, dict) else {}, "spatial_compression_ratio", 16)
    except ConfigError as exc:
        raise ModelDirError(f"{file}: {exc}") from None
    if round((target_size / s) ** 2) < 1:
        return {}
    sizes = ImageSizes(target_size, s)
    height, width = sizes(*DEFAULT_ASPECT)
    found = {"height": height, "width": width}
    index = folder / "model_index.json"
    pipeline = read_json_file(index, "model file") if index.is_file() else {}
    if isinstance(pipeline, dict) and pipeline.get("_class_name") == "HunyuanVideo15ImageToVideoPipeline":
        found["size_of_image"] = sizes
    return found


FOLDER_DEFAULTS = (
    FolderDefault("guidance", "guider/guider_config.json", "guidance_scale"),
    FolderDefault("height, width, size_of_image", "transformer/config.json", "target_size", int, derive=default_size),
)
SCHEDULE_BY_SIGMAS = True  # the pipeline sets the sigmas (np.linspace(1, 0, steps + 1)[:-1])
# Text tokens every block attends besides the video: SigLIP's semantic tokens (masked out in
# text-to-video), ByT5's glyph text (256, masked where the prompt quotes none) and the Qwen
# prompt (max_text_len); the runtime drops the masked ones, the memory model counts them all.
IMAGE_TOKENS, GLYPH_TOKENS = 729, 256
VAE_ACTIVATION_FACTOR = 6.0  # HunyuanVideo's decoder's (runtime/models/hunyuan/shapes.py); not calibrated for this one


def shape_of(name: str, config: dict, params: int, text_len: int, vae_stride: tuple[int, int, int]) -> ModelShape:
    """The model's shape from its transformer config: `layers` dual-stream blocks, each a joint
    self-attention over the video and every text token; the latent channels are the output's
    (the input adds the condition latents and their mask)."""
    heads, head_dim = int(config.get("num_attention_heads", 16)), int(config.get("attention_head_dim", 128))
    p, p_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
    return ModelShape(
        name=name,
        layers=int(config.get("num_layers", 54)),
        heads=heads,
        head_dim=head_dim,
        ffn=int(float(config.get("mlp_ratio", 4.0)) * heads * head_dim),
        text_len=text_len + IMAGE_TOKENS + GLYPH_TOKENS,
        params=params,
        text_dim=int(config.get("text_embed_dim", 3584)),
        latent_channels=int(config.get("out_channels") or 32),
        patch=(p_t, p, p),
        vae_stride=vae_stride,
        joint_text=True,
    )


def block_params(config: dict) -> int:
    """Parameters of one `HunyuanVideo15TransformerBlock` (checked against the meta-device block
    by tests/test_hunyuan15.py): per stream a 6C AdaLN table, q/k/v and out projections, a
    4x MLP; RMS norms of q and k on both streams."""
    c = int(config.get("num_attention_heads", 16)) * int(config.get("attention_head_dim", 128))
    d = int(config.get("attention_head_dim", 128))
    m = int(float(config.get("mlp_ratio", 4.0)) * c)
    stream = (c * 6 * c + 6 * c) + 4 * (c * c + c) + (c * m + m) + (m * c + c)
    return 2 * stream + 4 * d


def blocks_params(config: dict) -> int:
    """All the blocks (the rest is the root: embedders, token refiner, head)."""
    return int(config.get("num_layers", 54)) * block_params(config)


def fsdp_gathered_params(config: dict, hidden: int, layers: int) -> int:
    """What --shard-weights gathers per forward: every block whole."""
    return blocks_params(config)


def vae_strides(config: dict) -> tuple[int, int]:
    """(time, space) compression of an `AutoencoderKLHunyuanVideo15` config."""
    return config_int(config, "temporal_compression_ratio", 4), config_int(config, "spatial_compression_ratio", 16)


def rope_max_seq_len(config: dict) -> int:
    """Patches per axis the positions may reach: the rotary angles are computed for each size."""
    return 1024


def vae_shape_of(config: dict, params: int) -> VaeShape:
    """The decoder of an `AutoencoderKLHunyuanVideo15` config as diffusers builds it: up blocks
    from the widest, spatial upsampling in the first log2(spatial) of them, temporal in the
    first log2(temporal); the whole clip in one pass (no frame chunks, no causal caches).
    Each resolution holds its own block's width: the upsampler convolves at the lower
    resolution into the next block's channels times the factor and rearranges them into
    pixels (HunyuanVideo's interpolates first, so its higher resolution holds the wider
    channels; counted so here, the widest activation came out twice the traced one)."""
    widths = [int(w) for w in config.get("block_out_channels", (128, 256, 512, 1024, 1024))][::-1]
    t, s = vae_strides(config)
    n = len(widths)
    time_up = tuple(i < t.bit_length() - 1 for i in range(n))
    return VaeShape(
        params,
        int(config.get("latent_channels", 32)),
        s,
        t,
        1,
        tuple(widths),
        (0,) * n,
        time_up,
        chunk_frames=1 << 20,
        chunk_stride=1 << 20,
        masked_attention=True,
        causal_frames=False,
        activation_factor=VAE_ACTIVATION_FACTOR,
    )


def count_params(config: dict) -> int:
    """Parameters of a transformer with this config, built on the meta device (no memory)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    known = set(HunyuanVideo15Transformer3DModel.extract_init_dict(config)[0])
    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel(**{k: v for k, v in config.items() if k in known})
    return sum(p.numel() for p in model.parameters())


def expert_schedule(variant, timesteps: list[float], num_train_timesteps: int) -> list[int]:
    """One expert."""
    return [0] * len(timesteps)
