"""The SkyReels-V2 family's shapes: what a checkpoint asks of the loop and what the registry,
the memory model and the cost model need of its transformer and VAE.

The transformer's blocks, norms and projections are Wan2.1's, so the block counts, the model
shape and the decoder's shape are the Wan family's functions; what differs is the class that
counts the parameters (a diffusion-forcing config adds an fps embedding), the way the
pipelines size their latents (from the VAE's `temperal_downsample`), and the defaults.
"""

from __future__ import annotations

from pathlib import Path

import torch

from basics.errors import ConfigError
from runtime.models.protocol import FolderDefault, Variant
from runtime.models.wan.shapes import (
    block_params,
    blocks_params,
    expert_schedule,
    fsdp_gathered_params,
    rope_max_seq_len,
    shape_of,
    vae_shape_of,
)

__all__ = [
    "FOLDER_DEFAULTS", "GUIDANCE", "I2V", "PIPELINE_DEFAULTS", "SCHEDULE_BY_SIGMAS", "T2V", "block_params",
    "blocks_params", "count_params", "expert_schedule", "fsdp_gathered_params", "pipeline_guidance",
    "rope_max_seq_len", "shape_of", "vae_shape_of", "vae_strides",
]  # fmt: skip

T2V = Variant(pipeline="SkyReelsV2Pipeline")
# The image reaches the model twice: VAE latents joined on the channels, CLIP embeddings in the
# cross-attention (CLIPVisionModelWithProjection's penultimate hidden states).
I2V = Variant(pipeline="SkyReelsV2ImageToVideoPipeline", image="required", image_encoder=True)

# SkyReelsV2Pipeline's __call__ defaults: 544x960 (540p), 97 frames, 50 steps, guidance 6.0, no
# negative prompt; its example writes 24 fps. SkyReelsV2ImageToVideoPipeline's guidance is 5.0:
# the I2V named models say so, and a folder's model_index.json names its pipeline
# (`FOLDER_DEFAULTS`: each pipeline's own).
GUIDANCE = {T2V.pipeline: 6.0, I2V.pipeline: 5.0}
PIPELINE_DEFAULTS: dict = {
    "negative_prompt": "",
    "guidance": GUIDANCE[T2V.pipeline],
    "height": 544,
    "width": 960,
    "frames": 97,
    "fps": 24,
}


def pipeline_guidance(pipeline: str, folder: Path) -> dict:
    """{guidance: the __call__ default of the pipeline a folder names} ({} for one not run here)."""
    return {"guidance": GUIDANCE[pipeline]} if pipeline in GUIDANCE else {}


FOLDER_DEFAULTS = (FolderDefault("guidance", "model_index.json", "_class_name", str, derive=pipeline_guidance),)
SCHEDULE_BY_SIGMAS = False  # the loop sets the number of steps: every solver of schedulers.py applies


def vae_strides(config: dict) -> tuple[int, int]:
    """(time, space) compression as the SkyReels-V2 pipelines size their latents: 2 to the
    number of temporal downsamplings and 2 to the number of levels of the VAE's
    `temperal_downsample` (WanPipeline reads `scale_factor_*` instead; for Wan2.1's VAE both
    give (4, 8))."""
    down = config.get("temperal_downsample", [False, True, True])
    if not isinstance(down, list) or not down or not all(isinstance(d, bool) for d in down):
        raise ConfigError(f"temperal_downsample must be a list of true/false, got {down!r}")
    return 2 ** sum(down), 2 ** len(down)


def count_params(config: dict) -> int:
    """Parameters of a `SkyReelsV2Transformer3DModel` with this config, built on the meta device."""
    from diffusers import SkyReelsV2Transformer3DModel

    known = set(SkyReelsV2Transformer3DModel.extract_init_dict(config)[0])
    with torch.device("meta"):
        model = SkyReelsV2Transformer3DModel(**{k: v for k, v in config.items() if k in known})
    return sum(p.numel() for p in model.parameters())
