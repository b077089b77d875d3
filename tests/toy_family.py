"""A model family defined outside the package, as a user's plugin would be: its own transformer
and pipeline classes (Wan's, renamed: the family brings them in CLASSES, so a folder naming them
loads without diffusers knowing them), registered by `DITANGO_FAMILIES=tests.toy_family` in every
rank. It reuses the Wan family's functions, as a Wan-derived model would; nothing outside this
module names it."""

from __future__ import annotations

from diffusers import ModelMixin, WanPipeline, WanTransformer3DModel

from runtime.models import wan
from runtime.models.protocol import FolderDefault, NamedModel, TextEncoders
from runtime.models.wan.shapes import WanVariant

KEY = "toy"


class ToyTransformer3DModel(WanTransformer3DModel):
    """The toy's transformer: a class diffusers does not have."""


class ToyPipeline(WanPipeline):
    """The toy's pipeline (the exact reference), saved as `_class_name` "ToyPipeline"."""


CLASSES = {c.__name__: c for c in (ToyTransformer3DModel, ToyPipeline)}
# diffusers' pipeline loader checks a component of another library against the base classes
# that library names: a module of model classes names ModelMixin.
__all__ = ["ModelMixin", *CLASSES]
TRANSFORMER_CLASS, VAE_CLASS, PIPELINES = "ToyTransformer3DModel", wan.VAE_CLASS, ("ToyPipeline",)
COMPONENTS = {**wan.COMPONENTS, "transformer": (TRANSFORMER_CLASS,), "transformer_2": (TRANSFORMER_CLASS,)}
REQUIRED = wan.REQUIRED
PIPELINE_DEFAULTS = {"negative_prompt": "", "steps": 3, "guidance": 3.0, "fps": 12}
# Defaults a toy folder's own files may set: its guider's scale and a frame rate in model_index.json.
FOLDER_DEFAULTS = (
    FolderDefault("guidance", "guider/guider_config.json", "guidance_scale"),
    FolderDefault("fps", "model_index.json", "fps", int),
)
SCHEDULE_BY_SIGMAS = wan.SCHEDULE_BY_SIGMAS
# One named model, so `ditango models` and the planner know the family's sizes.
TOY_CONFIG = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "in_channels": 12,
              "out_channels": 12, "text_dim": 24, "patch_size": [1, 2, 2], "rope_max_seq_len": 64}  # fmt: skip
MODELS = (
    NamedModel(
        "toy-video",
        "a toy family registered from a test file",
        WanVariant(pipeline="ToyPipeline"),
        TOY_CONFIG,
        wan.count_params(TOY_CONFIG),
        {"scale_factor_spatial": 4},
        1,
        TextEncoders(1),
        repo_id="toy-org/toy-video",
    ),
)


def dir_variant(path, index, components, configs):
    return WanVariant(pipeline=index["_class_name"])


# Everything else as Wan's: the loop, the shapes, the decode and the parallel installation.
attention_shape = wan.attention_shape
block_params = wan.block_params
blocks_params = wan.blocks_params
count_params = wan.count_params
decode_tile = wan.decode_tile
expert_schedule = wan.expert_schedule
from_block = wan.from_block
fsdp_gathered_params = wan.fsdp_gathered_params
install = wan.install
install_tp = wan.install_tp
join_chunks = wan.join_chunks
load_model = wan.load_model
named_parts = wan.named_parts
pack_boundary = wan.pack_boundary
patch_size = wan.patch_size
probes = wan.probes
rope_max_seq_len = wan.rope_max_seq_len
segment_blocks = wan.segment_blocks
shape_of = wan.shape_of
tiling = wan.tiling
uninstall = wan.uninstall
uninstall_tp = wan.uninstall_tp
vae_chunks = wan.vae_chunks
vae_shape_of = wan.vae_shape_of
vae_strides = wan.vae_strides
