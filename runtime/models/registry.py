"""Registry of model names and how a `--model` argument resolves to components.

`--model` is a registry name (`tiny-wan`, `wan2.1-1.3b`, `wan2.1-14b`) or a path to a
diffusers-format directory. Real checkpoints are never downloaded: named ones resolve
under `--model-root` or `$DITANGO_MODEL_ROOT`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from planner.errors import ConfigError
from planner.models import MODELS, ModelShape
from runtime.errors import ModelDirError
from runtime.models.checkpoint import inspect_model_dir

MODEL_ROOT_ENV = "DITANGO_MODEL_ROOT"
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


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    shape: ModelShape  # the transformer (planner/models.py, the one model table)
    defaults: Defaults
    dir_name: str | None = None  # directory under the model root, for named checkpoints
    builtin: bool = False  # shipped inside the package (BUILTIN_DIR)

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


# The transformers' `rope_max_seq_len` where it is not diffusers' default of 1024 (Wan2.1: 1024).
ROPE_MAX_SEQ_LEN = {"tiny-wan": 256}


def _defaults(shape: ModelShape, **kwargs) -> Defaults:
    """Generation defaults with the geometry (VAE stride, patch, rotary table) of `shape`."""
    rope = ROPE_MAX_SEQ_LEN.get(shape.name, Defaults.rope_max_seq_len)
    return Defaults(vae_stride=shape.vae_stride[1], patch=shape.patch, rope_max_seq_len=rope, **kwargs)


# Wan2.1 settings: diffusers' WanPipeline defaults (50 steps, guidance 5.0, 832x480, 81 frames,
# 512 text tokens) and the checkpoints' transformer configs.
WAN_DEFAULTS = Defaults()

REGISTRY: dict[str, ModelSpec] = {
    "tiny-wan": ModelSpec(
        name="tiny-wan",
        description="built-in tiny Wan trained on moving shapes (runtime/models/tiny/weights)",
        shape=MODELS["tiny-wan"],
        defaults=_defaults(
            MODELS["tiny-wan"], steps=25, guidance=2.5, height=64, width=64, frames=17, fps=8, max_text_len=32
        ),
        builtin=True,
    ),
    "wan2.1-1.3b": ModelSpec(
        name="wan2.1-1.3b",
        description="Wan2.1 text-to-video 1.3B",
        shape=MODELS["wan2.1-1.3b"],
        defaults=WAN_DEFAULTS,
        dir_name="Wan2.1-T2V-1.3B-Diffusers",
    ),
    "wan2.1-14b": ModelSpec(
        name="wan2.1-14b",
        description="Wan2.1 text-to-video 14B",
        shape=MODELS["wan2.1-14b"],
        defaults=WAN_DEFAULTS,
        dir_name="Wan2.1-T2V-14B-Diffusers",
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    spec: ModelSpec
    path: Path  # the diffusers-format directory


def model_root(cli_root: str | Path | None) -> Path | None:
    root = cli_root or os.environ.get(MODEL_ROOT_ENV) or None
    return Path(root).expanduser() if root else None


def resolve_model(model: str, root: str | Path | None = None) -> ResolvedModel:
    """Turn a `--model` argument into a spec and a validated directory (weights not loaded)."""
    if model in REGISTRY:
        spec = REGISTRY[model]
        if spec.builtin:
            if not BUILTIN_DIR.is_dir():
                raise ModelDirError(f"the built-in model is missing from {BUILTIN_DIR} (a broken install?)")
            return ResolvedModel(spec, BUILTIN_DIR)
        base = model_root(root)
        if base is None:
            raise ConfigError(
                f"model {model!r} needs a local checkpoint: pass --model-root DIR or set {MODEL_ROOT_ENV} "
                f"so that DIR/{spec.dir_name} exists (weights are never downloaded)"
            )
        path = base / spec.dir_name
        if not path.is_dir():
            raise ModelDirError(f"model {model!r}: {path} does not exist (expected a diffusers-format checkpoint)")
        inspect_model_dir(path)
        return ResolvedModel(spec, path)

    path = Path(model).expanduser()
    if path.is_dir():
        info = inspect_model_dir(path)
        return ResolvedModel(spec_from_dir(path, info.transformer_config, info.transformer_params), path)
    if path.exists():
        raise ModelDirError(f"--model {model}: not a directory (expected a diffusers-format model directory)")
    names = ", ".join(REGISTRY)
    raise ConfigError(f"unknown model {model!r}: use one of {names}, or a path to a diffusers-format directory")


def spec_from_dir(path: Path, transformer_config: dict, params: int) -> ModelSpec:
    """A spec for a user-supplied directory: Wan defaults, shapes from its transformer config."""
    patch = tuple(int(p) for p in transformer_config.get("patch_size", WAN_DEFAULTS.patch))
    stride = vae_stride(path)
    rope = int(transformer_config.get("rope_max_seq_len", WAN_DEFAULTS.rope_max_seq_len))
    shape = ModelShape(
        name=str(path),
        layers=int(transformer_config.get("num_layers", 0)),
        heads=int(transformer_config.get("num_attention_heads", 0)),
        head_dim=int(transformer_config.get("attention_head_dim", 0)),
        ffn=int(transformer_config.get("ffn_dim", 0)),
        text_len=WAN_DEFAULTS.max_text_len,
        params=params,
        text_dim=int(transformer_config.get("text_dim", 4096)),
        latent_channels=int(transformer_config.get("in_channels", 16)),
        patch=patch,  # type: ignore[arg-type]
        vae_stride=(4, stride, stride),
    )
    return ModelSpec(
        name=str(path),
        description="local diffusers-format directory",
        shape=shape,
        defaults=replace(WAN_DEFAULTS, vae_stride=stride, patch=patch, rope_max_seq_len=rope),
    )


def vae_stride(path: Path) -> int:
    """Spatial compression of a directory's Wan VAE (diffusers' `scale_factor_spatial`, default 8)."""
    import json

    try:
        config = json.loads((path / "vae" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return WAN_DEFAULTS.vae_stride
    stride = config.get("scale_factor_spatial")  # what WanPipeline sizes its latents by
    return int(stride) if isinstance(stride, int) and stride > 0 else WAN_DEFAULTS.vae_stride
