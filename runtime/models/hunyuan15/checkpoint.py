"""What of a HunyuanVideo-1.5 checkpoint directory this tool honours (its pipelines, these
components with these classes, a guider it can run), and the configs of the public
checkpoints' other components, which a named model is built from without its weights
(runtime/models/meta.py)."""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ModelDirError
from runtime.models.protocol import Variant

T2V_PIPELINE, I2V_PIPELINE = "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"
PIPELINES = (T2V_PIPELINE, I2V_PIPELINE)
TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"
VAE_CLASS = "AutoencoderKLHunyuanVideo15"
COMPONENTS: dict[str, tuple[str, ...] | None] = {
    "tokenizer": None, "text_encoder": ("Qwen2_5_VLTextModel",), "transformer": (TRANSFORMER_CLASS,), "vae": (VAE_CLASS,),
    "scheduler": ("FlowMatchEulerDiscreteScheduler",), "text_encoder_2": ("T5EncoderModel",), "tokenizer_2": None,
    "guider": ("ClassifierFreeGuidance",), "image_encoder": ("SiglipVisionModel",), "feature_extractor": None,
}  # fmt: skip
REQUIRED = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2", "guider")
IMAGE_COMPONENTS = ("image_encoder", "feature_extractor")  # what image-to-video adds: SigLIP and its processor
# Image-to-video: the image's SigLIP tokens in the joint text, its latents in the first frame.
I2V = Variant(pipeline=I2V_PIPELINE, image="required", image_encoder=True)
# The guider's settings the denoising loop runs as the pipeline does (its other settings would
# change the prediction: refused rather than ignored).
GUIDER_AS_RUN = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0, "enabled": True}

# The public checkpoints' text encoders (Qwen2.5-VL-7B's language model, Glyph-ByT5's
# byt5-small encoder), schedulers and guider.
QWEN25_VL_7B_TEXT = {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 128000, "rope_theta": 1000000.0}  # fmt: skip
BYT5_SMALL = {"model_type": "t5", "d_model": 1472, "d_ff": 3584, "d_kv": 64, "num_layers": 12, "num_heads": 6, "vocab_size": 384,
              "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False}  # fmt: skip
# diffusers' conversion script (scripts/convert_hunyuan_video1_5_to_diffusers.py): shift 5.0 at
# 480p, 9.0 for 720p text-to-video and 7.0 for 720p image-to-video; guidance 6.0.
SHIFTS = {(640, False): 5.0, (640, True): 5.0, (960, False): 9.0, (960, True): 7.0}
GUIDER = {"_class_name": "ClassifierFreeGuidance", "guidance_scale": 6.0}


def named_parts(transformer_config: dict, vae_config: dict, variant) -> dict:
    """{component: (class name, config)} of a named checkpoint, built without its weights."""
    target = transformer_config.get("target_size", 640)
    parts = {
        "transformer": (TRANSFORMER_CLASS, transformer_config),
        "vae": (VAE_CLASS, vae_config),
        "text_encoder": ("Qwen2_5_VLTextModel", QWEN25_VL_7B_TEXT),
        "text_encoder_2": ("T5EncoderModel", BYT5_SMALL),
        "scheduler": ("FlowMatchEulerDiscreteScheduler", {"shift": SHIFTS.get((target, variant.image_encoder), 5.0)}),
        "guider": (GUIDER["_class_name"], GUIDER),
    }
    if variant.image_encoder:
        parts["image_encoder"] = ("SiglipVisionModel", SIGLIP_SO400M)
    return parts


# siglip-so400m-patch14-384's vision tower, the image-to-video checkpoints' image_encoder: 27 x 27
# patch tokens (the pipelines' vision_num_semantic_tokens, 729).
SIGLIP_SO400M = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                 "num_attention_heads": 16, "patch_size": 14, "image_size": 384}  # fmt: skip


def dir_variant(path: Path, index: dict, components: dict, configs: dict) -> Variant:
    """Text-to-video, or image-to-video with its SigLIP image encoder and processor; a guider
    the loop would not run as the pipeline does is refused by name."""
    from basics.user_files import read_json_file

    pipeline = index["_class_name"]
    guider_file = path / "guider" / "guider_config.json"
    guider = read_json_file(guider_file, "model file") if guider_file.is_file() else {}
    for key, value in GUIDER_AS_RUN.items():
        if key in guider and guider[key] != value:
            raise ModelDirError(f"{guider_file}: {key} {guider[key]!r} is not supported (ditango runs {value!r})")
    if pipeline == I2V_PIPELINE:
        missing = [name for name in IMAGE_COMPONENTS if name not in components]
        if missing:
            raise ModelDirError(f"{path}/model_index.json: a {I2V_PIPELINE} without {' or '.join(missing)}")
        return I2V
    if "image_encoder" in components:
        raise ModelDirError(f"{path}/model_index.json: a {T2V_PIPELINE} with an image_encoder")
    return Variant(pipeline=pipeline)
