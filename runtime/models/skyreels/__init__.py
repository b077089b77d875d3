"""The SkyReels-V2 family adapter: Skywork's text- and image-to-video models as diffusers runs
them (`SkyReelsV2Transformer3DModel`, `SkyReelsV2Pipeline`, `SkyReelsV2ImageToVideoPipeline`).

SkyReels-V2 is Wan2.1 retrained: diffusers' transformer is a copy of `WanTransformer3DModel`
with the same blocks, self-attention (projections, RMS norm across heads, interleaved rotary
from the same `rope` table), cross-attention (text keys, and for I2V the CLIP image's own
keys), condition embedder outputs and `proj_out`. So the parallel installation, tensor
parallelism, Hybridiff's segments, the step cache's probes, the VAE decode and the model
shapes are the Wan family's functions, applied unchanged. What differs, and where:

- the timestep's sinusoidal embedding is computed by another function
  (`get_1d_sincos_pos_embed_from_grid`): inside the condition embedder, which runs whole;
- the block passes an `attention_mask` to its self-attention: a causal block mask when the
  config's `num_frame_per_block` > 1, which only the diffusion-forcing pipelines set; such a
  config is refused (checkpoint.py), so the mask is always None here, as Wan's processor
  expects;
- `inject_sample_info` adds an fps embedding that only the diffusion-forcing pipelines pass
  (`fps=`); a transformer with it is refused, as are folders naming those pipelines;
- per-frame timesteps ([B, F], diffusion forcing) would give [B, F, C] time embeddings that
  are not per token: never reached, for the same reason (the pipelines run [B] timesteps);
- the pipelines size latents from the VAE's `temperal_downsample` rather than its
  `scale_factor_*` (shapes.py `vae_strides`), have no second expert, no per-token timesteps
  and no resolution rounding, always pass CLIP image embeddings in image-to-video (through a
  `CLIPVisionModelWithProjection` and a `CLIPProcessor`), and default to 544x960, 97 frames,
  guidance 6.0 (5.0 for I2V): loop.py runs the Wan loop over these pipelines' objects;
- the named models (models.py) are Skywork's checkpoints.
"""

from __future__ import annotations

import torch

from runtime.models import wan
from runtime.models.skyreels.checkpoint import (
    COMPONENTS,
    DIFFUSION_FORCING,
    PIPELINES,
    REQUIRED,
    TRANSFORMER_CLASS,
    VAE_CLASS,
    dir_variant,
    named_parts,
)
from runtime.models.skyreels.models import MODELS
from runtime.models.skyreels.shapes import (
    FOLDER_DEFAULTS,
    I2V,
    PIPELINE_DEFAULTS,
    SCHEDULE_BY_SIGMAS,
    T2V,
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

__all__ = [
    "COMPONENTS", "DIFFUSION_FORCING", "FOLDER_DEFAULTS", "I2V", "MODELS", "PIPELINES", "PIPELINE_DEFAULTS", "REQUIRED",
    "SCHEDULE_BY_SIGMAS", "T2V", "TRANSFORMER_CLASS", "VAE_CLASS", "attention_shape", "block_params", "blocks_params",
    "count_params", "decode_tile", "dir_variant", "expert_schedule", "from_block", "fsdp_gathered_params", "install",
    "install_tp", "join_chunks", "load_model", "named_parts", "pack_boundary", "patch_size", "probes",
    "rope_max_seq_len", "segment_blocks", "shape_of", "tiling", "uninstall", "uninstall_tp", "vae_chunks",
    "vae_shape_of", "vae_strides",
]  # fmt: skip


def load_model(components: dict, device: torch.device, max_text_len: int, variant=None):
    """The loaded checkpoint as the denoising loop drives it (runtime/models/skyreels/loop.py)."""
    from runtime.models.skyreels.loop import SkyReelsModel

    return SkyReelsModel(components, device, max_text_len, variant)


# Wan2.1's modules under other class names: the same hooks, processors and cuts apply.
install, uninstall = wan.install, wan.uninstall
install_tp, uninstall_tp = wan.install_tp, wan.uninstall_tp
attention_shape, patch_size = wan.attention_shape, wan.patch_size
segment_blocks, pack_boundary, from_block, probes = wan.segment_blocks, wan.pack_boundary, wan.from_block, wan.probes
# Wan2.1's VAE (AutoencoderKLWan, which the Wan family decodes too).
tiling, vae_chunks, decode_tile, join_chunks = wan.tiling, wan.vae_chunks, wan.decode_tile, wan.join_chunks
