"""The SkyReels-V2 family's named models: Skywork's diffusers-format text- and image-to-video
checkpoints, with the configs and parameter counts the registry, the memory model and the
meta-device builds read (tests/test_skyreels.py rebuilds each count).

The transformer configs are those diffusers' scripts/convert_skyreelsv2_to_diffusers.py writes
for each checkpoint (`get_transformer_config`), with the class defaults the keys leave out. The
public repositories' weight files agree: each component's safetensors bytes are 4 x its
parameter count (float32) plus the files' headers. The VAE is Wan2.1's, the text encoder
UMT5-XXL; the I2V image encoder is CLIP ViT-H/14 with its projection
(`CLIPVisionModelWithProjection`, laion/CLIP-ViT-H-14-laion2B-s32B-b79K), its processor a
`CLIPProcessor`.
"""

from __future__ import annotations

from runtime.models.protocol import NamedModel
from runtime.models.skyreels.shapes import GUIDANCE, I2V, T2V
from runtime.models.wan.models import CLIP_IMAGE_TOKENS, UMT5_XXL_PARAMS, WAN21_VAE, WAN21_VAE_PARAMS

T2V_14B = {
    "num_layers": 40, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "patch_size": [1, 2, 2], "image_dim": None,
    "added_kv_proj_dim": None, "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True, "eps": 1e-06,
    "inject_sample_info": False, "rope_max_seq_len": 1024,
}  # fmt: skip
I2V_14B = {**T2V_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
I2V_1_3B = {**I2V_14B, "num_layers": 30, "num_attention_heads": 12, "ffn_dim": 8960, "added_kv_proj_dim": 1536}
# CLIP ViT-H/14 (1280 wide, 32 layers) and its 1280 -> 1024 projection.
CLIP_VIT_H_PROJ_PARAMS = 632_076_800
P720 = {"height": 720, "width": 1280}
I2V_GUIDANCE = {"guidance": GUIDANCE[I2V.pipeline]}  # SkyReelsV2ImageToVideoPipeline's default


def _skyreels(name: str, description: str, repo: str, transformer: dict, params: int, **extra) -> NamedModel:
    """A public Skywork checkpoint: UMT5-XXL, Wan2.1's VAE, and CLIP ViT-H/14 for image-to-video."""
    variant = I2V if transformer["image_dim"] is not None else T2V
    image = variant.image_encoder
    return NamedModel(
        name,
        description,
        variant,
        transformer,
        params,
        WAN21_VAE,
        WAN21_VAE_PARAMS,
        UMT5_XXL_PARAMS,
        repo_id=f"Skywork/{repo}",
        image_encoder_params=CLIP_VIT_H_PROJ_PARAMS if image else 0,
        image_tokens=CLIP_IMAGE_TOKENS if image else 0,
        **extra,
    )


# What --shard-weights gathers in each forward of the transformer, and the root unit's at the
# first forward, counted on each config's meta build (the 14B ones are Wan2.1 14B's).
MODELS = (
    # SkyReelsV2Pipeline's defaults (50 steps, guidance 6.0, 97 frames); the pipeline's example
    # sets the scheduler's flow shift to 8 (--flow-shift 8).
    _skyreels("skyreels-v2-t2v-14b-540p", "SkyReels-V2 text-to-video 14B, 540p", "SkyReels-V2-T2V-14B-540P-Diffusers",
              T2V_14B, 14_288_491_584, fsdp_gathered=14_054_133_760, fsdp_root_gathered=205_173_824),
    _skyreels("skyreels-v2-t2v-14b-720p", "SkyReels-V2 text-to-video 14B, 720p", "SkyReels-V2-T2V-14B-720P-Diffusers",
              T2V_14B, 14_288_491_584, fsdp_gathered=14_054_133_760, fsdp_root_gathered=205_173_824, defaults=P720),
    # SkyReelsV2ImageToVideoPipeline's defaults (guidance 5.0); its example sets flow shift 5.
    _skyreels("skyreels-v2-i2v-1.3b-540p", "SkyReels-V2 image-to-video 1.3B, 540p (CLIP image encoder)",
              "SkyReels-V2-I2V-1.3B-540P-Diffusers", I2V_1_3B, 1_564_428_608, fsdp_gathered=1_538_155_776,
              fsdp_root_gathered=23_139_904, defaults=I2V_GUIDANCE),
    _skyreels("skyreels-v2-i2v-14b-540p", "SkyReels-V2 image-to-video 14B, 540p (CLIP image encoder)",
              "SkyReels-V2-I2V-14B-540P-Diffusers", I2V_14B, 16_394_878_784, fsdp_gathered=16_160_098_560,
              fsdp_root_gathered=205_583_424, defaults=I2V_GUIDANCE),
    _skyreels("skyreels-v2-i2v-14b-720p", "SkyReels-V2 image-to-video 14B, 720p (CLIP image encoder)",
              "SkyReels-V2-I2V-14B-720P-Diffusers", I2V_14B, 16_394_878_784, fsdp_gathered=16_160_098_560,
              fsdp_root_gathered=205_583_424, defaults={**I2V_GUIDANCE, **P720}),
)  # fmt: skip
