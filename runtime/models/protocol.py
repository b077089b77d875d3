"""The records a model family fills in (runtime/models/families.py has the protocol itself).

- `Variant`: what one checkpoint asks of the denoising loop (its diffusers pipeline, whether it
  takes an image, its experts). A family may subclass it for what only it has.
- `NamedModel`: one name `--model` accepts, in the family's own package: its Hugging Face repo,
  variant, component configs and parameter counts (for the memory model and meta-device
  builds), and the defaults its pipeline or model card sets.
- `FolderDefault`: a generation default a model folder's own config files set (a guider's
  scale, a frame rate): read from the folder when the model ships it, so the run uses the
  checkpoint's value rather than a table's.
- `Tiling`: how the tiled decode cuts a VAE's frames into tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from basics.errors import ConfigError

IMAGE_MODES = ("none", "optional", "required")


def config_int(config: dict, key: str, default: int) -> int:
    """A positive integer of a component's config (`default` where the key is absent or null);
    any other value is a one-line ConfigError naming the key (the config is the user's)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Variant:
    """What a checkpoint asks of the denoising loop, in the terms every family shares."""

    pipeline: str = ""  # the diffusers pipeline that is the exact reference
    image: str = "none"  # "required" (image-to-video), "optional" (text or image) or "none"
    boundary_ratio: float | None = None  # two experts: `transformer` at t >= ratio * T, then `transformer_2`
    expand_timesteps: bool = False  # per-token timesteps (Wan2.2 TI2V-5B)
    image_encoder: bool = False  # CLIP image embeddings in the cross-attention (Wan2.1 I2V)

    @property
    def experts(self) -> int:
        return 1 if self.boundary_ratio is None else 2

    @property
    def task(self) -> str:
        return {"required": "i2v", "optional": "ti2v", "none": "t2v"}[self.image]

    def image_pipeline(self) -> bool:
        """Whether an item with an image runs through the family's image-to-video path."""
        return self.image != "none"


@dataclass(frozen=True)
class TextEncoders:
    """The text encoders' parameters, for the memory model: all of them, the largest block
    (what FSDP gathers at once), those outside the blocks (embeddings, final norm), and those
    --shard-weights leaves whole (a small second encoder)."""

    params: int
    block: int = 0
    root: int = 0
    whole: int = 0


@dataclass(frozen=True)
class NamedModel:
    """One registry name: a public checkpoint (or the built-in model) of the family.

    `transformer` and `vae` are the checkpoint's config.json keys that decide the shape (a
    named model is built from them on the meta device, without its weights); `params` counts
    one transformer's parameters (`Family.count_params` of its config: the tests rebuild it),
    `vae_params` the VAE's. `defaults` override the family's `PIPELINE_DEFAULTS` (the model
    card's steps, sizes, guidance). `fsdp_gathered` / `fsdp_root_gathered`: what --shard-weights
    gathers per forward and at the first (None: the family's estimate)."""

    name: str
    description: str
    variant: Variant
    transformer: dict
    params: int
    vae: dict
    vae_params: int
    text: TextEncoders
    repo_id: str | None = None  # None: built in (runtime/models/tiny/weights)
    image_encoder_params: int = 0
    image_tokens: int = 0  # the image encoder's tokens in every cross-attention
    fsdp_gathered: int | None = None
    fsdp_root_gathered: int | None = None
    defaults: dict = field(default_factory=dict)

    @property
    def dir_name(self) -> str | None:
        """The folder it is looked for under --model-root: the repo's name."""
        return None if self.repo_id is None else self.repo_id.rpartition("/")[2]


@dataclass(frozen=True)
class FolderDefault:
    """A default (`Defaults` field) read from `file` (relative to the model folder) at `key`;
    `kind` is the type it must have (a float default also takes an integer).

    `derive`: for defaults the value implies rather than states (a pipeline's size from the
    transformer's target size, its guidance from its class): `derive(value, folder)` gives
    {Defaults field: value}, and `default` names what it sets, for the reader."""

    default: str
    file: str
    key: str
    kind: type = float
    derive: Callable[[Any, Path], dict] | None = None


@dataclass(frozen=True)
class Tiling:
    """A VAE's spatial tiles, in output pixels: `min_px` a side, one every `stride_px`;
    `ratio`: output pixels per latent pixel; `patch`: the decoder's output pixel blocks per side
    (its channels hold them; Wan2.2's VAE: 2). `enabled` False: every frame chunk is one tile.
    Tiles are blended with the VAE's `blend_v` / `blend_h`, as diffusers' tiled decodes do.
    `min_side`: the narrowest tile, in latents, the decoder takes (LTX-2's reflect-padded one: 2);
    a narrower last tile, which the one before it covers whole, is not decoded."""

    enabled: bool
    min_px: int
    stride_px: int
    ratio: int
    patch: int = 1
    min_side: int = 1
