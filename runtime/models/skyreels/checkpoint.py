"""What of a SkyReels-V2 checkpoint directory this tool honours: the text- and image-to-video
pipelines, these components with these classes; anything else would change what the pipeline
computes, so it is refused by name. The diffusion-forcing pipelines are declared too, so that
their folders are found to be this family's and refused in one line rather than as unknown.
And the configs of the public checkpoints' other components, which a named model is built
from without its weights (runtime/models/meta.py)."""

from __future__ import annotations

from pathlib import Path

from basics.errors import ConfigError
from runtime.errors import ModelDirError
from runtime.models.protocol import Variant, config_int
from runtime.models.skyreels.models import MODELS
from runtime.models.skyreels.shapes import I2V, T2V, vae_strides
from runtime.models.wan.checkpoint import CLIP_H_VISION, REQUIRED, UMT5_XXL
from runtime.models.wan.checkpoint import IMAGE_PROCESSOR_CLASSES as WAN_PROCESSORS

# Per-frame noise levels under a causal block mask, long videos in overlapping windows, fps
# conditioning: a different loop from the one ditango runs.
DIFFUSION_FORCING = (
    "SkyReelsV2DiffusionForcingPipeline",
    "SkyReelsV2DiffusionForcingImageToVideoPipeline",
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline",
)
PIPELINES = (T2V.pipeline, I2V.pipeline, *DIFFUSION_FORCING)
TRANSFORMER_CLASS = "SkyReelsV2Transformer3DModel"
VAE_CLASS = "AutoencoderKLWan"
# The pipeline reads the encoder's penultimate hidden states, which both CLIP vision classes
# give; the public checkpoints save a CLIPProcessor, whose image half the pipeline calls.
IMAGE_ENCODER_CLASSES = ("CLIPVisionModelWithProjection", "CLIPVisionModel")
IMAGE_PROCESSOR_CLASSES = ("CLIPProcessor", *WAN_PROCESSORS)
COMPONENTS: dict[str, tuple[str, ...] | None] = {
    "tokenizer": None, "text_encoder": None, "transformer": (TRANSFORMER_CLASS,), "vae": (VAE_CLASS,),
    "scheduler": None, "image_encoder": IMAGE_ENCODER_CLASSES, "image_processor": IMAGE_PROCESSOR_CLASSES,
}  # fmt: skip
__all__ = ["COMPONENTS", "DIFFUSION_FORCING", "PIPELINES", "REQUIRED", "TRANSFORMER_CLASS", "VAE_CLASS"]

# The scheduler diffusers' conversion script saves with every checkpoint (UniPC's default flow
# shift, 1.0; the pipelines' examples set 8.0 for text- and 5.0 for image-to-video).
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
             "use_flow_sigmas": True, "num_train_timesteps": 1000}  # fmt: skip


def named_parts(transformer_config: dict, vae_config: dict, variant: Variant) -> dict:
    """{component: (class name, config)} of a named checkpoint, built without its weights."""
    parts = {
        "transformer": (TRANSFORMER_CLASS, transformer_config),
        "vae": (VAE_CLASS, vae_config),
        "text_encoder": ("UMT5EncoderModel", UMT5_XXL),
        "scheduler": (SCHEDULER["_class_name"], SCHEDULER),
    }
    if variant.image_encoder:
        parts["image_encoder"] = ("CLIPVisionModelWithProjection", CLIP_H_VISION)
    return parts


def dir_variant(path: Path, index: dict, components: dict, configs: dict) -> Variant:
    """What the directory asks of the denoising loop, checked: a diffusion-forcing folder, or
    a transformer only the diffusion-forcing loop drives, is refused in one line."""
    pipeline, config = index["_class_name"], configs["transformer"]
    where = f"{path}/model_index.json"
    if pipeline in DIFFUSION_FORCING:
        names = ", ".join(m.name for m in MODELS)
        raise ModelDirError(
            f"{where} names {pipeline}: diffusion forcing (per-frame noise levels, causal blocks) is not supported; "
            f"use a SkyReels-V2 text- or image-to-video checkpoint ({names})"
        )
    for key, asks, what in (
        ("inject_sample_info", bool(config.get("inject_sample_info")), "an fps embedding (diffusion forcing's fps=)"),
        ("num_frame_per_block", config.get("num_frame_per_block", 1) != 1, "a causal block mask (diffusion forcing)"),
        ("pos_embed_seq_len", config.get("pos_embed_seq_len") is not None, "first- and last-frame image embeddings"),
    ):
        if asks:
            raise ModelDirError(f"{path}/transformer/config.json: {key} {config[key]!r} asks for {what}; not supported")
    wants_image = config.get("image_dim") is not None
    if pipeline == T2V.pipeline and (wants_image or "image_encoder" in components):
        raise ModelDirError(f"{where}: a {pipeline} with an image encoder; image-to-video is {I2V.pipeline}")
    if pipeline == I2V.pipeline:
        if not wants_image:
            raise ModelDirError(
                f"{path}: {pipeline} passes CLIP image embeddings, but the transformer has no image_dim"
            )
        missing = [n for n in ("image_encoder", "image_processor") if n not in components]
        if missing:
            raise ModelDirError(f"{where} lists no {' or '.join(missing)}, which {pipeline} runs")
        if config.get("in_channels") == config.get("out_channels"):
            raise ModelDirError(
                f"{path}: an {pipeline} whose transformer takes no condition channels "
                f"(in_channels = out_channels = {config.get('in_channels')})"
            )
    vae = configs["vae"]
    try:
        sized = vae_strides(vae)
        own = config_int(vae, "scale_factor_temporal", 4), config_int(vae, "scale_factor_spatial", 8)
    except ConfigError as exc:
        raise ModelDirError(f"{path}/vae/config.json: {exc}") from None
    if sized != own:
        raise ModelDirError(
            f"{path}/vae/config.json: the VAE compresses (time, space) {own}, but {pipeline} sizes its latents "
            f"{sized} from temperal_downsample; SkyReels-V2 runs Wan2.1's VAE"
        )
    return I2V if pipeline == I2V.pipeline else T2V
