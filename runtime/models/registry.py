"""Registry of model names: each entry's checkpoint, shape, defaults and components.

`--model` is a registry name (`ditango models` lists them), a Hugging Face repo id
(ORG/NAME[@REVISION]) or a path to a diffusers-format directory; runtime/models/resolve.py
resolves it to a checked directory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from basics.errors import ConfigError
from planner.models import ModelShape
from runtime.models import hub
from runtime.models.families import FAMILIES
from runtime.models.wan import WanVariant

BUILTIN_DIR = Path(__file__).resolve().parent / "tiny" / "weights"  # tiny-wan, a diffusers directory


@dataclass(frozen=True)
class Defaults:
    """Per-model generation defaults; the command line and prompt files override them."""

    steps: int = 50
    guidance: float = 5.0
    height: int = 480
    width: int = 832
    frames: int = 81
    fps: int = 16
    max_text_len: int = 512
    negative_prompt: str = ""
    vae_stride: int = 8  # geometry: VAE spatial compression and transformer patch
    patch: tuple[int, int, int] = (1, 2, 2)
    # Patches per axis (frames, height, width) the transformer's rotary table covers
    # (diffusers' `rope_max_seq_len`): a larger video fails inside the model with a reshape error.
    rope_max_seq_len: int = 1024
    guidance_2: float | None = None  # the low-noise expert's CFG scale; None: one expert
    image: str = "none"  # "required" (image-to-video), "optional" (TI2V) or "none"
    experts: int = 1  # 2: Wan2.2 A14B (guidance_2 applies)
    # HunyuanVideo: `guidance` is the embedded (distilled) guidance and real classifier-free
    # guidance is this scale (diffusers' true_cfg_scale; two branches only when > 1). None: a
    # family whose `guidance` is the CFG scale itself (Wan).
    true_cfg: float | None = None

    @property
    def cfg_scale(self) -> float:
        """The classifier-free guidance scale: two branches per step when > 1."""
        return self.guidance if self.true_cfg is None else self.true_cfg


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    shape: ModelShape  # the transformer, from its config through the family adapter
    defaults: Defaults
    dir_name: str | None = None  # directory under the model root, for named checkpoints
    repo_id: str | None = None  # its Hugging Face repo (None: built in)
    builtin: bool = False  # shipped inside the package (BUILTIN_DIR)
    variant: WanVariant = WanVariant()
    family: str = "wan"  # its key in runtime/models/families.py
    config_key: str = ""  # its entry in CONFIGS (several names share one config)

    @property
    def params(self) -> int:
        return self.shape.params

    @property
    def heads(self) -> int:
        return self.shape.heads

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def task(self) -> str:
        return self.variant.task

    def resolves_to(self, root: Path | None) -> str:
        """Where `--model NAME` resolves, in words: built-in, a directory, an HF cache snapshot, or how to fetch it."""
        if self.builtin:
            return "built-in"
        found = hub.locate(self.repo_id, None, root, (self.dir_name,))
        return found[1] if found else f"not found: ditango download {self.name}"

    def to_json(self, root: Path | None) -> dict:
        """The row of `ditango models --json`."""
        d = self.defaults
        return {
            "name": self.name,
            "repo_id": self.repo_id,
            "family": self.family,
            "task": self.task,
            "experts": self.variant.experts,
            "params": self.params,
            "heads": self.heads,
            "layers": self.layers,
            "head_dim": self.head_dim,
            "defaults": {
                "steps": d.steps,
                "guidance": d.guidance,
                "guidance_2": d.guidance_2,
                "height": d.height,
                "width": d.width,
                "frames": d.frames,
                "fps": d.fps,
            },
            "resolves_to": self.resolves_to(root),
            "description": self.description,
        }


# Transformer configs of the public diffusers-format checkpoints (their transformer/config.json;
# the keys that decide the shape). Wan2.2 A14B's two experts share one config.
WAN21_14B = {
    "num_layers": 40, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "patch_size": [1, 2, 2],
    "image_dim": None, "added_kv_proj_dim": None, "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True,
    "rope_max_seq_len": 1024,
}  # fmt: skip
CONFIGS = {
    "wan2.1-1.3b": {**WAN21_14B, "num_layers": 30, "num_attention_heads": 12, "ffn_dim": 8960},
    "wan2.1-14b": WAN21_14B,
    "wan2.1-i2v-14b": {**WAN21_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
    "wan2.2-t2v-a14b": WAN21_14B,
    "wan2.2-i2v-a14b": {**WAN21_14B, "in_channels": 36},
    "wan2.2-ti2v-5b": {**WAN21_14B, "num_layers": 30, "num_attention_heads": 24, "ffn_dim": 14336,
                       "in_channels": 48, "out_channels": 48},
}  # fmt: skip
# Parameters of one transformer of each config (`wan.count_params`, checked by the tests).
PARAMS = {
    "wan2.1-1.3b": 1_418_996_800,
    "wan2.1-14b": 14_288_491_584,
    "wan2.1-i2v-14b": 16_394_878_784,
    "wan2.2-t2v-a14b": 14_288_491_584,
    "wan2.2-i2v-a14b": 14_288_901_184,
    "wan2.2-ti2v-5b": 4_999_787_712,
    "hunyuanvideo": 12_821_012_544,
}
# What --shard-weights gathers in each forward of one transformer (ModelShape.fsdp_gathered_params),
# counted on each config's meta build (tests/test_rehearse.py rebuilds them).
FSDP_GATHERED = {
    "wan2.1-1.3b": 1_392_852_480,
    "wan2.1-14b": 14_054_133_760,
    "wan2.1-i2v-14b": 16_160_098_560,
    "wan2.2-t2v-a14b": 14_054_133_760,
    "wan2.2-i2v-a14b": 14_054_543_360,
    "wan2.2-ti2v-5b": 4_908_963_840,
    "hunyuanvideo": 12_724_631_552,
}
FSDP_ROOT_GATHERED = {  # the root unit's (gathered once, at the first forward)
    "wan2.1-1.3b": 23_017_024,
    "wan2.1-14b": 205_173_824,
    "wan2.1-i2v-14b": 205_583_424,
    "wan2.2-t2v-a14b": 205_173_824,
    "wan2.2-i2v-a14b": 205_583_424,
    "wan2.2-ti2v-5b": 79_850_688,
    "hunyuanvideo": 96_380_992,
}
# HunyuanVideo (hunyuanvideo-community/HunyuanVideo): 20 dual-stream + 40 single-stream blocks.
HUNYUAN_CONFIG = {
    "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 20, "num_single_layers": 40,
    "num_refiner_layers": 2, "in_channels": 16, "out_channels": 16, "mlp_ratio": 4.0, "patch_size": 2,
    "patch_size_t": 1, "text_embed_dim": 4096, "pooled_projection_dim": 768, "rope_axes_dim": [16, 56, 56],
    "guidance_embeds": True,
}  # fmt: skip
CONFIGS["hunyuanvideo"] = HUNYUAN_CONFIG
TINY_CONFIG = {
    "num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 48, "ffn_dim": 768, "in_channels": 12,
    "out_channels": 12, "text_dim": 32, "patch_size": [1, 2, 2], "rope_max_seq_len": 256,
}  # fmt: skip

# The other components, for the memory model (planner/memory.py). VAE configs: the checkpoints'
# vae/config.json (Wan2.1 and the A14B models use AutoencoderKLWan's defaults; the tiny one is
# runtime/models/tiny/weights/vae/config.json). Parameter counts: each class built from its
# config on the meta device (tests/test_memory.py rebuilds them).
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "patch_size": 2,
             "scale_factor_spatial": 16, "in_channels": 12, "out_channels": 12}  # fmt: skip
TINY_VAE = {"base_dim": 32, "z_dim": 12, "dim_mult": [1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [True, True],
            "scale_factor_spatial": 4}  # fmt: skip
VAE_CONFIGS = {"wan": {}, "wan2.2-ti2v-5b": WAN22_VAE, "tiny-wan": TINY_VAE, "hunyuanvideo": {}}
VAE_PARAMS = {"wan": 126_892_531, "wan2.2-ti2v-5b": 704_688_668, "tiny-wan": 785_999, "hunyuanvideo": 246_478_803}
# Text encoders: (all parameters, the largest block, the root: embeddings and final norm, those
# --shard-weights leaves whole). UMT5-XXL encoder (d_model 4096, d_ff 10240, 24 layers, 64 heads,
# vocab 256384); HunyuanVideo: its Llama-3-8B-class LlamaModel (vocab 128320, 32 layers) and
# CLIP-L text (123,060,480, not sharded); the tiny UMT5.
TEXT_ENCODERS = {
    "wan": (5_680_910_336, 192_948_224, 1_050_152_960, 0),
    "hunyuanvideo": (7_505_186_816 + 123_060_480, 218_112_000, 525_602_816, 123_060_480),
    "tiny-wan": (22_176, 10_336, 1_504, 0),
}
CLIP_VIT_H_PARAMS = 630_766_080  # Wan2.1 I2V's CLIPVisionModel (ViT-H/14, 1280 wide, 32 layers)
CLIP_IMAGE_TOKENS = 257  # 16 x 16 patches + the class token


def vae_key(config_key: str, family: str) -> str:
    """The VAE_CONFIGS / VAE_PARAMS entry of a named model: its own, else its family's."""
    return config_key if config_key in VAE_CONFIGS else family


def _spec(
    name: str,
    description: str,
    config_key: str,
    dir_name: str | None,
    variant: WanVariant,
    vae_stride: int = 8,
    params: int | None = None,
    builtin: bool = False,
    family: str = "wan",
    org: str = "Wan-AI",
    **defaults,
) -> ModelSpec:
    """A registry entry: shape from the transformer config (through its family), defaults from
    diffusers' pipeline (the family's) and the model card, geometry from the config and VAE.
    `dir_name` is also the repo's name on the Hub: its repo id is `org`/`dir_name`."""
    adapter = FAMILIES[family]
    config = TINY_CONFIG if config_key == "tiny-wan" else CONFIGS[config_key]
    n = PARAMS.get(config_key, 0) if params is None else params
    defaults = {**adapter.PIPELINE_DEFAULTS, **defaults}
    text_len = defaults.get("max_text_len", Defaults.max_text_len)
    shape = adapter.shape_of(name, config, n * variant.experts, text_len, (4, vae_stride, vae_stride))
    vae = vae_key(config_key, family)
    shape = with_components(
        shape,
        adapter,
        config,
        variant,
        TEXT_ENCODERS[config_key if config_key in TEXT_ENCODERS else family],
        CLIP_VIT_H_PARAMS if variant.image_encoder else 0,
        VAE_CONFIGS[vae],
        VAE_PARAMS[vae],
        FSDP_GATHERED.get(config_key),
        FSDP_ROOT_GATHERED.get(config_key),
    )
    geometry = Defaults(
        vae_stride=vae_stride,
        patch=shape.patch,
        rope_max_seq_len=int(config.get("rope_max_seq_len", 1024)),
        image=variant.image,
        experts=variant.experts,
    )
    repo = None if dir_name is None else f"{org}/{dir_name}"
    return ModelSpec(
        name, description, shape, replace(geometry, **defaults), dir_name, repo, builtin, variant, family, config_key
    )


def with_components(
    shape: ModelShape,
    adapter,
    config: dict,
    variant: WanVariant,
    text: tuple[int, int, int, int],
    image_params: int,
    vae_config: dict,
    vae_params: int,
    fsdp_gathered: int | None = None,
    fsdp_root_gathered: int | None = None,
) -> ModelShape:
    """`shape` with what the memory model needs of the transformer's blocks and the other
    components. `fsdp_gathered` None: the family's estimate (the exact count, with the root's
    module lists, is FSDP_GATHERED's)."""
    per_expert = shape.params // max(1, variant.experts)
    blocks = adapter.blocks_params(config)
    if fsdp_gathered is None:
        fsdp_gathered = adapter.fsdp_gathered_params(config, shape.hidden, shape.layers)
    try:
        vae = adapter.vae_shape_of(vae_config, vae_params)
    except ConfigError:  # a VAE whose scale factor disagrees with its decoder: its decode is not modelled
        vae = None
    return replace(
        shape,
        block_params=adapter.block_params(config),
        root_params=max(0, per_expert - blocks),
        fsdp_gathered_params=fsdp_gathered,
        fsdp_root_gathered_params=max(0, per_expert - blocks) if fsdp_root_gathered is None else fsdp_root_gathered,
        text_encoder_params=text[0],
        text_encoder_block_params=text[1],
        text_encoder_root_params=text[2],
        text_encoder_whole_params=text[3],
        image_encoder_params=image_params,
        image_tokens=CLIP_IMAGE_TOKENS if image_params else 0,
        per_token_time=variant.expand_timesteps,
        vae=vae,
    )


T2V, I2V = WanVariant(), WanVariant(pipeline="WanImageToVideoPipeline", image_encoder=True)
P720 = {"height": 720, "width": 1280}
REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _spec(
            "tiny-wan",
            "built-in tiny Wan trained on moving shapes (runtime/models/tiny/weights)",
            "tiny-wan",
            None,
            T2V,
            vae_stride=4,
            max_text_len=32,
            params=2_712_816,
            builtin=True,
            steps=25,
            guidance=2.5,
            height=64,
            width=64,
            frames=17,
            fps=8,
            negative_prompt="",
        ),  # trained without one
        # Wan2.1: diffusers' WanPipeline / WanImageToVideoPipeline defaults (50 steps, guidance 5.0, 81 frames).
        _spec("wan2.1-1.3b", "Wan2.1 text-to-video 1.3B", "wan2.1-1.3b", "Wan2.1-T2V-1.3B-Diffusers", T2V),
        _spec("wan2.1-14b", "Wan2.1 text-to-video 14B", "wan2.1-14b", "Wan2.1-T2V-14B-Diffusers", T2V),
        _spec(
            "wan2.1-i2v-14b-480p",
            "Wan2.1 image-to-video 14B, 480p (CLIP image encoder)",
            "wan2.1-i2v-14b",
            "Wan2.1-I2V-14B-480P-Diffusers",
            I2V,
        ),
        _spec(
            "wan2.1-i2v-14b-720p",
            "Wan2.1 image-to-video 14B, 720p (CLIP image encoder)",
            "wan2.1-i2v-14b",
            "Wan2.1-I2V-14B-720P-Diffusers",
            I2V,
            **P720,
        ),
        # Wan2.2 (the model cards' settings): two 14B experts switched at boundary_ratio x 1000.
        _spec(
            "wan2.2-t2v-a14b",
            "Wan2.2 text-to-video, two 14B experts",
            "wan2.2-t2v-a14b",
            "Wan2.2-T2V-A14B-Diffusers",
            WanVariant(boundary_ratio=0.875),
            steps=40,
            guidance=4.0,
            guidance_2=3.0,
            **P720,
        ),
        _spec(
            "wan2.2-i2v-a14b",
            "Wan2.2 image-to-video, two 14B experts",
            "wan2.2-i2v-a14b",
            "Wan2.2-I2V-A14B-Diffusers",
            WanVariant(pipeline="WanImageToVideoPipeline", boundary_ratio=0.9),
            steps=40,
            guidance=3.5,
            guidance_2=3.5,
        ),
        _spec(
            "wan2.2-ti2v-5b",
            "Wan2.2 text/image-to-video 5B, per-token timesteps, 16x VAE",
            "wan2.2-ti2v-5b",
            "Wan2.2-TI2V-5B-Diffusers",
            WanVariant(expand_timesteps=True),
            vae_stride=16,
            height=704,
            width=1280,
            frames=121,
            fps=24,
        ),
        # HunyuanVideo: HunyuanVideoPipeline's defaults (720x1280, 129 frames, 50 steps, embedded guidance 6.0).
        _spec(
            "hunyuanvideo",
            "HunyuanVideo text-to-video 13B (joint text-video attention)",
            "hunyuanvideo",
            "HunyuanVideo",
            WanVariant(pipeline="HunyuanVideoPipeline"),
            family="hunyuanvideo",
            org="hunyuanvideo-community",
        ),
    )
}

# Short names users type for a registry entry (--model takes them).
ALIASES = {"wan2.2-a14b": "wan2.2-t2v-a14b"}
