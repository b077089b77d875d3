"""The HunyuanVideo family's named model (hunyuanvideo-community/HunyuanVideo, diffusers'
format), with the configs and counts the registry, the memory model and the meta-device builds
read (tests/test_memory.py and tests/test_rehearse.py rebuild each count)."""

from __future__ import annotations

from runtime.models.protocol import NamedModel, TextEncoders, Variant

# 20 dual-stream + 40 single-stream blocks.
HUNYUAN = {
    "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 20, "num_single_layers": 40,
    "num_refiner_layers": 2, "in_channels": 16, "out_channels": 16, "mlp_ratio": 4.0, "patch_size": 2,
    "patch_size_t": 1, "text_embed_dim": 4096, "pooled_projection_dim": 768, "rope_axes_dim": [16, 56, 56],
    "guidance_embeds": True,
}  # fmt: skip
# Its Llama-3-8B-class LlamaModel (vocab 128320, 32 layers) and CLIP-L's text model
# (123,060,480 parameters, which --shard-weights leaves whole).
TEXT = TextEncoders(7_505_186_816 + 123_060_480, 218_112_000, 525_602_816, 123_060_480)

MODELS = (
    # HunyuanVideoPipeline's defaults (720x1280, 129 frames, 50 steps, embedded guidance 6.0).
    NamedModel(
        "hunyuanvideo",
        "HunyuanVideo text-to-video 13B (joint text-video attention)",
        Variant(pipeline="HunyuanVideoPipeline"),
        HUNYUAN,
        12_821_012_544,
        {},  # AutoencoderKLHunyuanVideo's defaults
        246_478_803,
        TEXT,
        repo_id="hunyuanvideo-community/HunyuanVideo",
        fsdp_gathered=12_724_631_552,
        fsdp_root_gathered=96_380_992,
    ),
)
