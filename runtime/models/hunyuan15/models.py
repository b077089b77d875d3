"""The HunyuanVideo-1.5 family's named models: the diffusers-format checkpoints of
hunyuanvideo-community (the repo names of diffusers' HunyuanVideo15Pipeline and
HunyuanVideo15ImageToVideoPipeline examples), with the configs and counts the registry, the
memory model and the meta-device builds read (tests/test_hunyuan15.py rebuilds each count)."""

from __future__ import annotations

from runtime.models.hunyuan15.checkpoint import I2V
from runtime.models.hunyuan15.shapes import ImageSizes
from runtime.models.protocol import NamedModel, TextEncoders, Variant

# HunyuanVideo15Transformer3DModel's defaults are the 8.3B model's; 480p and 720p differ in the
# target size the pipeline derives its default height and width from.
T2V_480P = {
    "in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 54,
    "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm",
    "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152, "rope_theta": 256.0,
    "rope_axes_dim": [16, 56, 56], "target_size": 640, "task_type": "t2v", "use_meanflow": False,
}  # fmt: skip
T2V_720P = {**T2V_480P, "target_size": 960}
# Image-to-video: the same transformer (its 65 input channels hold the image's latents and
# mask), marked "i2v" (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py).
I2V_480P, I2V_720P = ({**config, "task_type": "i2v"} for config in (T2V_480P, T2V_720P))
TRANSFORMER_PARAMS = 8_326_608_160
VAE: dict = {}  # AutoencoderKLHunyuanVideo15's defaults: 32 latent channels, 16x in space, 4x in time
VAE_PARAMS = 1_260_634_115
# Qwen2.5-VL-7B's language model (28 layers of 233,057,792; 545,000,960 outside them) and the
# ByT5 glyph encoder (217,657,472, which --shard-weights leaves whole).
TEXT = TextEncoders(7_070_619_136 + 217_657_472, 233_057_792, 545_000_960, 217_657_472)
T2V = Variant(pipeline="HunyuanVideo15Pipeline")
# SigLIP-so400m's vision tower with its pooling head (checkpoint.py SIGLIP_SO400M on the meta
# device). Its 729 tokens are in the joint text the shape counts (shapes.py IMAGE_TOKENS), so
# the named models count no cross-attention image tokens.
SIGLIP_PARAMS = 428_225_600
# HunyuanVideo15ImageToVideoPipeline sizes the video by its image: these are a 16:9 image's.
I2V_480P_SIZE = {"height": 480, "width": 848, "size_of_image": ImageSizes(640, 16)}
I2V_720P_SIZE = {"height": 720, "width": 1280, "size_of_image": ImageSizes(960, 16)}

MODELS = (
    NamedModel("hunyuanvideo-1.5-480p-t2v", "HunyuanVideo-1.5 text-to-video 8.3B, 480p (16x VAE)", T2V, T2V_480P,
               TRANSFORMER_PARAMS, VAE, VAE_PARAMS, TEXT, repo_id="hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
               defaults={"height": 480, "width": 848}),
    NamedModel("hunyuanvideo-1.5-720p-t2v", "HunyuanVideo-1.5 text-to-video 8.3B, 720p (16x VAE)", T2V, T2V_720P,
               TRANSFORMER_PARAMS, VAE, VAE_PARAMS, TEXT, repo_id="hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v",
               defaults={"height": 720, "width": 1280}),
    NamedModel("hunyuanvideo-1.5-480p-i2v", "HunyuanVideo-1.5 image-to-video 8.3B, 480p (16x VAE, SigLIP)", I2V,
               I2V_480P, TRANSFORMER_PARAMS, VAE, VAE_PARAMS, TEXT, image_encoder_params=SIGLIP_PARAMS,
               repo_id="hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v", defaults=I2V_480P_SIZE),
    NamedModel("hunyuanvideo-1.5-720p-i2v", "HunyuanVideo-1.5 image-to-video 8.3B, 720p (16x VAE, SigLIP)", I2V,
               I2V_720P, TRANSFORMER_PARAMS, VAE, VAE_PARAMS, TEXT, image_encoder_params=SIGLIP_PARAMS,
               repo_id="hunyuanvideo-community/HunyuanVideo-1.5-720p_i2v", defaults=I2V_720P_SIZE),
)  # fmt: skip
