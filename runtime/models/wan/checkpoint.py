"""What of a Wan checkpoint directory this tool honours: these pipelines, these components
with these classes, and these model_index.json keys. Anything else would change what the
pipeline computes, so runtime/models/checkpoint.py refuses it by name rather than loading and
ignoring it. And the configs of the public checkpoints' other components, which a named
model is built from without its weights (runtime/models/meta.py)."""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ModelDirError
from runtime.models.wan.shapes import WanVariant, same_architecture

PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
TRANSFORMER_CLASS = "WanTransformer3DModel"
VAE_CLASS = "AutoencoderKLWan"
# The pipeline reads the encoder's penultimate hidden states: both CLIP vision classes give them.
IMAGE_ENCODER_CLASSES = ("CLIPVisionModel", "CLIPVisionModelWithProjection")
# transformers 5 saves its PIL fallback's name where torchvision is missing.
IMAGE_PROCESSOR_CLASSES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")
# The components it runs: name -> the classes honoured there (None: any).
COMPONENTS: dict[str, tuple[str, ...] | None] = {
    "tokenizer": None, "text_encoder": None, "transformer": (TRANSFORMER_CLASS,), "transformer_2": (TRANSFORMER_CLASS,),
    "vae": (VAE_CLASS,), "scheduler": None, "image_encoder": IMAGE_ENCODER_CLASSES,
    "image_processor": IMAGE_PROCESSOR_CLASSES,
}  # fmt: skip
REQUIRED = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")

# The public checkpoints' text encoder, image encoder and scheduler (their config files; the
# keys that decide the shape). Parameter counts equal the registry's (tests/test_rehearse.py).
UMT5_XXL = {"model_type": "umt5", "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_layers": 24, "num_heads": 64, "vocab_size": 256384,
            "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128}  # fmt: skip
CLIP_H_VISION = {"model_type": "clip_vision_model", "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16, "num_hidden_layers": 32,
                 "patch_size": 14, "image_size": 224, "projection_dim": 1024}  # fmt: skip
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
             "use_flow_sigmas": True, "flow_shift": 3.0, "num_train_timesteps": 1000, "solver_order": 2}  # fmt: skip


def named_parts(transformer_config: dict, vae_config: dict, variant: WanVariant) -> dict:
    """{component: (class name, config)} of a named checkpoint, built without its weights."""
    parts = {
        "transformer": (TRANSFORMER_CLASS, transformer_config),
        "vae": (VAE_CLASS, vae_config),
        "text_encoder": ("UMT5EncoderModel", UMT5_XXL),
        "scheduler": (SCHEDULER["_class_name"], SCHEDULER),
    }
    if variant.experts == 2:
        parts["transformer_2"] = parts["transformer"]
    if variant.image_encoder:
        parts["image_encoder"] = ("CLIPVisionModel", CLIP_H_VISION)
    return parts


def dir_variant(path: Path, index: dict, components: dict, configs: dict) -> WanVariant:
    """What the directory asks of the denoising loop, checked for consistency."""
    config, config_2 = configs["transformer"], configs.get("transformer_2")
    where = f"{path}/model_index.json"
    ratio, expand = index.get("boundary_ratio"), index.get("expand_timesteps", False)
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
        raise ModelDirError(f"{where}: boundary_ratio must be a number in (0, 1), got {ratio!r}")
    if not isinstance(expand, bool):
        raise ModelDirError(f"{where}: expand_timesteps must be true or false, got {expand!r}")
    if (ratio is None) != (config_2 is None):
        what = (
            "a second expert (transformer_2) but no boundary_ratio"
            if ratio is None
            else (f"boundary_ratio {ratio} but no second expert (transformer_2)")
        )
        raise ModelDirError(f"{where} has {what}: diffusers would not run both experts; ditango refuses it")
    if config_2 is not None and (differ := same_architecture(config, config_2)):
        raise ModelDirError(
            f"{path}: transformer and transformer_2 differ in {', '.join(differ)}; ditango needs "
            "experts of one architecture"
        )
    pipeline = index["_class_name"]
    wants_image = config.get("image_dim") is not None
    if wants_image and "image_encoder" not in components:
        raise ModelDirError(
            f"{path}: the transformer takes CLIP image embeddings (image_dim) but there is no image_encoder"
        )
    if pipeline == "WanPipeline" and ("image_encoder" in components or wants_image):
        raise ModelDirError(f"{where}: a WanPipeline with an image encoder; image-to-video is WanImageToVideoPipeline")
    if wants_image and "image_processor" not in components:
        raise ModelDirError(f"{where} lists an image_encoder but no image_processor")
    if pipeline == "WanImageToVideoPipeline" and not expand and config.get("in_channels") == config.get("out_channels"):
        raise ModelDirError(
            f"{path}: a WanImageToVideoPipeline whose transformer takes no condition channels "
            f"(in_channels = out_channels = {config.get('in_channels')})"
        )
    return WanVariant(
        pipeline=pipeline,
        boundary_ratio=None if ratio is None else float(ratio),
        expand_timesteps=expand,
        image_encoder="image_encoder" in components,
    )
