"""Registry of model names: each entry's checkpoint, shape, defaults and components, built
from the named models of every family (runtime/models/<family>/models.py, and the families
registered from their own modules: `register_family`).

`--model` is a registry name (`ditango models` lists them), a Hugging Face repo id
(ORG/NAME[@REVISION]) or a path to a diffusers-format directory; runtime/models/resolve.py
resolves it to a checked directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from basics.errors import ConfigError
from planner.models import ModelShape
from runtime.models import hub
from runtime.models.families import FAMILIES, check_family
from runtime.models.protocol import NamedModel, TextEncoders, Variant

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
    vae_stride: int = 8  # geometry: VAE spatial and temporal compression, transformer patch
    temporal_stride: int = 4  # frames are temporal_stride x k + 1
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
    # An image-to-video pipeline that sizes the video by its image (HunyuanVideo-1.5's): called
    # with the image's (height, width), the (height, width) of an item that gives neither.
    # None: `height` x `width`, as for every other model.
    size_of_image: Callable[[int, int], tuple[int, int]] | None = None

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
    variant: Variant = Variant()
    family: str = "wan"  # its key in runtime/models/families.py
    named: NamedModel | None = field(default=None, compare=False, repr=False)  # None: a user's folder

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


def spec_of(family: str, model: NamedModel) -> ModelSpec:
    """A registry entry from a family's named model: shape from the transformer config (through
    the family), defaults from the family's pipeline and the model card, geometry from the
    config and the VAE's."""
    adapter = FAMILIES[family]
    variant = model.variant
    defaults = {**adapter.PIPELINE_DEFAULTS, **model.defaults}
    text_len = defaults.get("max_text_len", Defaults.max_text_len)
    t, s = adapter.vae_strides(model.vae)
    shape = adapter.shape_of(model.name, model.transformer, model.params * variant.experts, text_len, (t, s, s))
    shape = with_components(
        shape,
        adapter,
        model.transformer,
        variant,
        model.text,
        model.image_encoder_params,
        model.image_tokens,
        model.vae,
        model.vae_params,
        model.fsdp_gathered,
        model.fsdp_root_gathered,
    )
    geometry = geometry_of(adapter, model.transformer, shape, variant, (t, s))
    return ModelSpec(
        model.name,
        model.description,
        shape,
        replace(geometry, **defaults),
        model.dir_name,
        model.repo_id,
        model.repo_id is None,
        variant,
        family,
        model,
    )


def geometry_of(adapter, config: dict, shape: ModelShape, variant: Variant, strides: tuple[int, int]) -> Defaults:
    """The `Defaults` a model's geometry fixes: VAE strides, patch, rotary extent, image, experts."""
    return Defaults(
        vae_stride=strides[1],
        temporal_stride=strides[0],
        patch=shape.patch,
        rope_max_seq_len=adapter.rope_max_seq_len(config),
        image=variant.image,
        experts=variant.experts,
    )


def with_components(
    shape: ModelShape,
    adapter,
    config: dict,
    variant: Variant,
    text: TextEncoders,
    image_params: int,
    image_tokens: int,
    vae_config: dict,
    vae_params: int,
    fsdp_gathered: int | None = None,
    fsdp_root_gathered: int | None = None,
) -> ModelShape:
    """`shape` with what the memory model needs of the transformer's blocks and the other
    components. `fsdp_gathered` None: the family's estimate (the exact count, with the root's
    module lists, is a named model's)."""
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
        text_encoder_params=text.params,
        text_encoder_block_params=text.block,
        text_encoder_root_params=text.root,
        text_encoder_whole_params=text.whole,
        image_encoder_params=image_params,
        image_tokens=image_tokens if image_params else 0,
        per_token_time=variant.expand_timesteps,
        vae=vae,
    )


def named_models(family: str) -> dict[str, ModelSpec]:
    """A family's named models, by name."""
    return {model.name: spec_of(family, model) for model in FAMILIES[family].MODELS}


REGISTRY: dict[str, ModelSpec] = {name: spec for family in FAMILIES for name, spec in named_models(family).items()}
BUILTIN_FAMILIES = tuple(FAMILIES)
PLUGINS_ENV = "DITANGO_FAMILIES"  # comma-separated modules, each a family whose KEY names it
ENTRY_POINTS = "ditango.families"  # installed packages' families: name = KEY, value = the module


def register_family(key: str, family) -> None:
    """Add a model family (a module or object with every member of `families.Family`) and its
    named models: its checkpoints resolve, load and parallelize as the built-in families' do.
    Registering the same one again changes nothing; a name or class another family has is refused."""
    if FAMILIES.get(key) is family:
        return
    if key in FAMILIES:
        raise ValueError(f"model family {key!r} is already registered")
    check_family(key, family)
    FAMILIES[key] = family
    try:
        specs = named_models(key)
        if taken := sorted(set(specs) & set(REGISTRY)):
            raise ValueError(f"model family {key!r} names {', '.join(taken)}, which another family has")
    except BaseException:
        del FAMILIES[key]
        raise
    REGISTRY.update(specs)


def unregister_family(key: str) -> None:
    """Remove a registered family and its named models (a built-in family stays)."""
    if key in BUILTIN_FAMILIES:
        raise ValueError(f"model family {key!r} is built in")
    family = FAMILIES.pop(key, None)
    for model in getattr(family, "MODELS", ()):
        REGISTRY.pop(model.name, None)


def load_plugins() -> None:
    """Register the families $DITANGO_FAMILIES names and the installed `ditango.families` entry
    points (each rank imports this module, so each registers them); a module that cannot be
    imported, or is no family, is a one-line ConfigError."""
    import importlib
    import os
    from importlib.metadata import entry_points

    named = [(m.strip(), None) for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    found = [(e.value, e.name) for e in entry_points(group=ENTRY_POINTS)]
    for module_name, name in named + found:
        try:
            module = importlib.import_module(module_name)
            register_family(name or getattr(module, "KEY", module_name.rpartition(".")[2]), module)
        except (ImportError, TypeError, ValueError) as exc:
            raise ConfigError(f"model family {module_name} ({PLUGINS_ENV} or {ENTRY_POINTS}): {exc}") from None


# What a family named in the environment could not register with: the command says it in one
# line before anything else (ditango_cli/app.py); a rank that imports this module goes on.
PLUGIN_ERRORS: list[str] = []
try:
    load_plugins()
except ConfigError as exc:
    PLUGIN_ERRORS.append(str(exc))


def known_text_encoders() -> tuple[TextEncoders, ...]:
    """The text encoders of every named model (a folder's is recognised by its size)."""
    return tuple(dict.fromkeys(m.text for f in FAMILIES.values() for m in f.MODELS))


# Short names users type for a registry entry (--model takes them).
ALIASES = {"wan2.2-a14b": "wan2.2-t2v-a14b"}
