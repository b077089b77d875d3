"""The Wan family's named models: the public diffusers-format checkpoints and the built-in
tiny model, with the configs and parameter counts the registry, the memory model and the
meta-device builds read (tests/test_memory.py and tests/test_rehearse.py rebuild each count)."""

from __future__ import annotations

from runtime.models.protocol import NamedModel, TextEncoders
from runtime.models.wan.shapes import WanVariant

# Transformer configs (their transformer/config.json; the keys that decide the shape). Wan2.2
# A14B's two experts share one config.
WAN21_14B = {
    "num_layers": 40, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "patch_size": [1, 2, 2],
    "image_dim": None, "added_kv_proj_dim": None, "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True,
    "rope_max_seq_len": 1024,
}  # fmt: skip
WAN21_1_3B = {**WAN21_14B, "num_layers": 30, "num_attention_heads": 12, "ffn_dim": 8960}
WAN21_I2V_14B = {**WAN21_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
WAN22_I2V_A14B = {**WAN21_14B, "in_channels": 36}
WAN22_TI2V_5B = {**WAN21_14B, "num_layers": 30, "num_attention_heads": 24, "ffn_dim": 14336, "in_channels": 48,
                 "out_channels": 48}  # fmt: skip
TINY = {
    "num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 48, "ffn_dim": 768, "in_channels": 12,
    "out_channels": 12, "text_dim": 32, "freq_dim": 64, "patch_size": [1, 2, 2], "rope_max_seq_len": 256,
}  # fmt: skip
# VAE configs: Wan2.1 and the A14B models use AutoencoderKLWan's defaults; the tiny one is
# runtime/models/tiny/weights/vae/config.json.
WAN21_VAE: dict = {}
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "patch_size": 2,
             "scale_factor_spatial": 16, "in_channels": 12, "out_channels": 12}  # fmt: skip
TINY_VAE = {"base_dim": 32, "z_dim": 12, "dim_mult": [1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [True, True],
            "scale_factor_spatial": 4}  # fmt: skip
WAN21_VAE_PARAMS, WAN22_VAE_PARAMS, TINY_VAE_PARAMS = 126_892_531, 704_688_668, 785_999
# The UMT5-XXL encoder (d_model 4096, d_ff 10240, 24 layers, 64 heads, vocab 256384); the tiny UMT5.
UMT5_XXL_PARAMS = TextEncoders(5_680_910_336, 192_948_224, 1_050_152_960, 0)
TINY_UMT5_PARAMS = TextEncoders(22_176, 10_336, 1_504, 0)
CLIP_VIT_H_PARAMS = 630_766_080  # Wan2.1 I2V's CLIPVisionModel (ViT-H/14, 1280 wide, 32 layers)
CLIP_IMAGE_TOKENS = 257  # 16 x 16 patches + the class token

T2V, I2V = WanVariant(), WanVariant(pipeline="WanImageToVideoPipeline", image_encoder=True)
P720 = {"height": 720, "width": 1280}


def _wan(name: str, description: str, repo: str, variant: WanVariant, transformer: dict, params: int, **extra):
    """A public Wan-AI checkpoint: UMT5-XXL, Wan2.1's VAE unless given, CLIP ViT-H with an image encoder."""
    image = variant.image_encoder
    return NamedModel(
        name,
        description,
        variant,
        transformer,
        params,
        extra.pop("vae", WAN21_VAE),
        extra.pop("vae_params", WAN21_VAE_PARAMS),
        UMT5_XXL_PARAMS,
        repo_id=f"Wan-AI/{repo}",
        image_encoder_params=CLIP_VIT_H_PARAMS if image else 0,
        image_tokens=CLIP_IMAGE_TOKENS if image else 0,
        **extra,
    )


# What --shard-weights gathers in each forward of one transformer, and the root unit's at the
# first forward, counted on each config's meta build (tests/test_rehearse.py rebuilds them).
MODELS = (
    NamedModel(
        "tiny-wan",
        "built-in tiny Wan trained on moving shapes (runtime/models/tiny/weights)",
        T2V,
        TINY,
        2_712_816,
        TINY_VAE,
        TINY_VAE_PARAMS,
        TINY_UMT5_PARAMS,
        # trained without a negative prompt
        defaults={"max_text_len": 32, "steps": 25, "guidance": 2.5, "height": 64, "width": 64, "frames": 17, "fps": 8,
                  "negative_prompt": ""},
    ),
    # Wan2.1: diffusers' WanPipeline / WanImageToVideoPipeline defaults (50 steps, guidance 5.0, 81 frames).
    _wan("wan2.1-1.3b", "Wan2.1 text-to-video 1.3B", "Wan2.1-T2V-1.3B-Diffusers", T2V, WAN21_1_3B, 1_418_996_800,
         fsdp_gathered=1_392_852_480, fsdp_root_gathered=23_017_024),
    _wan("wan2.1-14b", "Wan2.1 text-to-video 14B", "Wan2.1-T2V-14B-Diffusers", T2V, WAN21_14B, 14_288_491_584,
         fsdp_gathered=14_054_133_760, fsdp_root_gathered=205_173_824),
    _wan("wan2.1-i2v-14b-480p", "Wan2.1 image-to-video 14B, 480p (CLIP image encoder)", "Wan2.1-I2V-14B-480P-Diffusers",
         I2V, WAN21_I2V_14B, 16_394_878_784, fsdp_gathered=16_160_098_560, fsdp_root_gathered=205_583_424),
    _wan("wan2.1-i2v-14b-720p", "Wan2.1 image-to-video 14B, 720p (CLIP image encoder)", "Wan2.1-I2V-14B-720P-Diffusers",
         I2V, WAN21_I2V_14B, 16_394_878_784, fsdp_gathered=16_160_098_560, fsdp_root_gathered=205_583_424,
         defaults=P720),
    # Wan2.2 (the model cards' settings): two 14B experts switched at boundary_ratio x 1000.
    _wan("wan2.2-t2v-a14b", "Wan2.2 text-to-video, two 14B experts", "Wan2.2-T2V-A14B-Diffusers",
         WanVariant(boundary_ratio=0.875), WAN21_14B, 14_288_491_584, fsdp_gathered=14_054_133_760,
         fsdp_root_gathered=205_173_824, defaults={"steps": 40, "guidance": 4.0, "guidance_2": 3.0, **P720}),
    _wan("wan2.2-i2v-a14b", "Wan2.2 image-to-video, two 14B experts", "Wan2.2-I2V-A14B-Diffusers",
         WanVariant(pipeline="WanImageToVideoPipeline", boundary_ratio=0.9), WAN22_I2V_A14B, 14_288_901_184,
         fsdp_gathered=14_054_543_360, fsdp_root_gathered=205_583_424,
         defaults={"steps": 40, "guidance": 3.5, "guidance_2": 3.5}),
    _wan("wan2.2-ti2v-5b", "Wan2.2 text/image-to-video 5B, per-token timesteps, 16x VAE", "Wan2.2-TI2V-5B-Diffusers",
         WanVariant(expand_timesteps=True), WAN22_TI2V_5B, 4_999_787_712, vae=WAN22_VAE, vae_params=WAN22_VAE_PARAMS,
         fsdp_gathered=4_908_963_840, fsdp_root_gathered=79_850_688,
         defaults={"height": 704, "width": 1280, "frames": 121, "fps": 24}),
)  # fmt: skip
