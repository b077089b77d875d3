"""What of a HunyuanVideo checkpoint directory this tool honours (text-to-video: these
components with these classes), and the configs of the public checkpoint's other
components, which the named model is built from without its weights (runtime/models/meta.py)."""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ModelDirError
from runtime.models.protocol import Variant

PIPELINES = ("HunyuanVideoPipeline",)
TRANSFORMER_CLASS = "HunyuanVideoTransformer3DModel"
VAE_CLASS = "AutoencoderKLHunyuanVideo"
COMPONENTS: dict[str, tuple[str, ...] | None] = {
    "tokenizer": None, "text_encoder": ("LlamaModel",), "transformer": (TRANSFORMER_CLASS,), "vae": (VAE_CLASS,),
    "scheduler": None, "text_encoder_2": ("CLIPTextModel",), "tokenizer_2": None,
}  # fmt: skip
REQUIRED = tuple(COMPONENTS)

# The public checkpoint's text encoders (a Llama-3-8B-class LlamaModel and CLIP-L's text model)
# and scheduler. Parameter counts equal the registry's (tests/test_rehearse.py).
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128320, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 8192}  # fmt: skip
CLIP_L_TEXT = {"model_type": "clip_text_model", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
               "max_position_embeddings": 77, "projection_dim": 768}  # fmt: skip
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 7.0}


def named_parts(transformer_config: dict, vae_config: dict, variant) -> dict:
    """{component: (class name, config)} of the named checkpoint, built without its weights."""
    return {
        "transformer": (TRANSFORMER_CLASS, transformer_config),
        "vae": (VAE_CLASS, vae_config),
        "text_encoder": ("LlamaModel", LLAMA_8B),
        "text_encoder_2": ("CLIPTextModel", CLIP_L_TEXT),
        "scheduler": (SCHEDULER["_class_name"], SCHEDULER),
    }


def dir_variant(path: Path, index: dict, components: dict, configs: dict):
    """One expert, text-to-video: a transformer conditioned on an image is refused."""
    condition = configs["transformer"].get("image_condition_type")
    if condition is not None:
        raise ModelDirError(f"{path}: HunyuanVideo image conditioning ({condition}) is not supported")
    return Variant(pipeline=index["_class_name"])
