"""What of an LTX-2 checkpoint directory this tool honours (its text- and image-to-video pipelines, these
components with these classes), and the configs of the public checkpoint's other components,
which a named model is built from without its weights (runtime/models/meta.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from runtime.errors import ModelDirError
from runtime.models.protocol import Variant

T2V_PIPELINE, I2V_PIPELINE = "LTX2Pipeline", "LTX2ImageToVideoPipeline"
PIPELINES = (T2V_PIPELINE, I2V_PIPELINE)
TRANSFORMER_CLASS = "LTX2VideoTransformer3DModel"
VAE_CLASS = "AutoencoderKLLTX2Video"
COMPONENTS: dict[str, tuple[str, ...] | None] = {
    "tokenizer": None, "text_encoder": None, "connectors": ("LTX2TextConnectors",), "transformer": (TRANSFORMER_CLASS,),
    "vae": (VAE_CLASS,), "audio_vae": ("AutoencoderKLLTX2Audio",), "vocoder": ("LTX2Vocoder", "LTX2VocoderWithBWE"),
    "scheduler": ("FlowMatchEulerDiscreteScheduler",),
}  # fmt: skip
REQUIRED = ("tokenizer", "text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder", "scheduler")
# One checkpoint makes video from text, or from an image and text (LTX2ImageToVideoPipeline): an
# item with an image runs the image-to-video path, whichever pipeline the folder names.
T2V = Variant(pipeline=T2V_PIPELINE, image="optional")

# The public checkpoint's other components (diffusers' scripts/convert_ltx2_to_diffusers.py,
# version 2.0, and its non-distilled scheduler).
AUDIO_VAE = {
    "base_channels": 128, "output_channels": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2, "in_channels": 2,
    "latent_channels": 8, "norm_type": "pixel", "causality_axis": "height", "mid_block_add_attention": False,
    "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True, "mel_bins": 64, "double_z": True,
}  # fmt: skip
VOCODER = {
    "in_channels": 128, "hidden_channels": 1024, "out_channels": 2, "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_factors": [6, 5, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11],
    "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "output_sampling_rate": 24000,
}  # fmt: skip
CONNECTORS = {
    "caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128, "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128, "connector_rope_base_seq_len": 4096, "rope_type": "split",
}  # fmt: skip
SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}
# gemma-3-12b-it (its SigLIP tower is loaded, never run by the text path).
GEMMA3_12B = {
    "model_type": "gemma3",
    "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "patch_size": 14, "image_size": 896},
}  # fmt: skip


def named_parts(transformer_config: dict, vae_config: dict, variant) -> dict:
    """{component: (class name, config)} of a named checkpoint, built without its weights."""
    return {
        "transformer": (TRANSFORMER_CLASS, transformer_config),
        "vae": (VAE_CLASS, vae_config),
        "audio_vae": ("AutoencoderKLLTX2Audio", AUDIO_VAE),
        "vocoder": ("LTX2Vocoder", VOCODER),
        "connectors": ("LTX2TextConnectors", CONNECTORS),
        "text_encoder": ("Gemma3ForConditionalGeneration", GEMMA3_12B),
        "scheduler": ("FlowMatchEulerDiscreteScheduler", SCHEDULER),
    }


def dir_variant(path: Path, index: dict, components: dict, configs: dict) -> Variant:
    """Text or image to video, whichever pipeline the folder names (the same components)."""
    vae = configs.get("vae", {})
    if vae.get("timestep_conditioning"):
        raise ModelDirError(f"{path}/vae/config.json: a timestep-conditioned LTX-2 VAE is not supported")
    return replace(T2V, pipeline=index["_class_name"])
