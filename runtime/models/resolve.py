"""How a `--model` argument resolves to a spec and a checked directory.

`--model` is a registry name (`ditango models` lists them), a Hugging Face repo id
(ORG/NAME[@REVISION]) or a path to a diffusers-format directory. Names and repo ids are looked
for under `--model-root` / `$DITANGO_MODEL_ROOT`, then in the Hugging Face cache, and are
downloaded only when the user asks (runtime/models/hub.py); a directory is checked against
the family that runs it (runtime/models/checkpoint.py) and, for a name, against its entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import user_path
from runtime.errors import ModelDirError
from runtime.models import hub
from runtime.models.checkpoint import ModelDirInfo, count_params, inspect_model_dir
from runtime.models.families import FAMILIES
from runtime.models.hub import MODEL_ROOT_ENV, model_root
from runtime.models.protocol import TextEncoders
from runtime.models.registry import (
    BUILTIN_DIR,
    REGISTRY,
    Defaults,
    ModelSpec,
    geometry_of,
    known_text_encoders,
    with_components,
)


@dataclass(frozen=True)
class ResolvedModel:
    spec: ModelSpec
    path: Path  # the diffusers-format directory


def model_source(model: str) -> str:
    """Where a `--model` argument is read from, as `resolve_model` reads it: "built-in"; "folder"
    (a diffusers directory, as it is) or "cache folder" (a cache's models--ORG--NAME, whose
    revision picks a snapshot); else "hub" (a registry name or repo id: looked for under
    --model-root, then in the Hugging Face cache, then downloaded where allowed)."""
    name = model.partition("@")[0] if hub.is_repo_id(model.partition("@")[0]) else model
    spec = REGISTRY.get(name) or next((s for s in REGISTRY.values() if s.repo_id == name), None)
    if spec is not None and spec.builtin:
        return "built-in"
    path = user_path(model, "--model")
    if name not in REGISTRY and path.is_dir():  # a path that exists is that directory
        return "cache folder" if path.name.startswith(hub.CACHE_PREFIX) and (path / "snapshots").is_dir() else "folder"
    return "hub"


def resolve_model(
    model: str, root: str | Path | None = None, revision: str | None = None, download: bool = False
) -> ResolvedModel:
    """A `--model` argument (a registry name; a Hub repo id ORG/NAME[@REVISION], the registry's
    being its entry; a diffusers directory or a cache's models--ORG--NAME) as a spec and a checked
    directory: under `root`, then in the HF cache, then (`download`, never on a rank) fetched."""
    name, revision = hub.split_revision(model, revision)
    spec = REGISTRY.get(name) or next((s for s in REGISTRY.values() if s.repo_id == name), None)
    source = model_source(model)
    if source == "built-in":
        if not BUILTIN_DIR.is_dir():
            raise ModelDirError(f"the built-in model is missing from {BUILTIN_DIR} (a broken install?)")
        return ResolvedModel(spec, BUILTIN_DIR)
    path = user_path(model, "--model")
    if source != "hub":
        path = hub.repo_folder_snapshot(path, revision) or path
        return ResolvedModel(spec_from_dir(path, inspect_model_dir(path)), path)
    if name not in REGISTRY and path.exists():
        raise ModelDirError(f"--model {model}: not a directory (expected a diffusers-format model directory)")
    repo_id = spec.repo_id if spec is not None else name if hub.is_repo_id(name) else None
    if repo_id is None:
        raise ConfigError(
            f"unknown model {model!r}: use one of {', '.join(REGISTRY)}, a Hugging Face repo id "
            "(ORG/NAME), or a path to a diffusers-format directory"
        )
    base = model_root(root)
    found = hub.locate(repo_id, revision, base, () if spec is None else (spec.dir_name,))
    if found is None and not download:
        raise hub.missing(name, repo_id, revision, base, MODEL_ROOT_ENV)
    return checked_dir(spec, found[0] if found else hub.download(repo_id, revision))


def checked_dir(spec: ModelSpec | None, path: Path) -> ResolvedModel:
    """`path` validated as the checkpoint of `spec` (None: whatever diffusers directory it is)."""
    info = inspect_model_dir(path)
    found = spec_from_dir(path, info)
    mismatch = None if spec is None else _differs(spec, found)
    if mismatch:
        raise ModelDirError(f"model {spec.name!r}: {path} is not that checkpoint ({mismatch})")
    if spec is None:
        return ResolvedModel(found, path)
    own = folder_defaults(path, FAMILIES[found.family])  # the folder's configs over the model card's
    return ResolvedModel(replace(spec, variant=info.variant, defaults=replace(spec.defaults, **own)), path)


def _differs(spec: ModelSpec, found: ModelSpec) -> str | None:
    """What of a named model's directory disagrees with its registry entry (None: nothing)."""
    ours, theirs = spec.variant, found.variant
    for what, a, b in (
        ("pipeline", ours.pipeline, theirs.pipeline),
        ("experts", ours.experts, theirs.experts),
        ("boundary_ratio", ours.boundary_ratio, theirs.boundary_ratio),
        ("expand_timesteps", ours.expand_timesteps, theirs.expand_timesteps),
        ("layers", spec.layers, found.layers),
        ("heads", spec.heads, found.heads),
        ("head_dim", spec.head_dim, found.head_dim),
        ("VAE stride", spec.defaults.vae_stride, found.defaults.vae_stride),
        ("VAE time stride", spec.defaults.temporal_stride, found.defaults.temporal_stride),
    ):
        if a != b:
            return f"{what} {b!r} where {spec.name} has {a!r}"
    return None


def spec_from_dir(path: Path, info: ModelDirInfo) -> ModelSpec:
    """A spec for a user-supplied directory: the family's pipeline defaults under those the
    folder's own configs set, shapes from its transformer config (through the family), the
    VAE's strides from its config, what it asks for from its model_index.json."""
    config, variant = info.transformer_config, info.variant
    adapter = FAMILIES[info.family]
    vae_config = _json_object(path / "vae" / "config.json")
    try:
        t, s = adapter.vae_strides(vae_config)
    except ConfigError as exc:
        raise ModelDirError(f"{path}/vae/config.json: {exc}") from None
    counts = {
        n: count_params(sorted((path / n).glob("*.safetensors"))) if (path / n).is_dir() else 0
        for n in ("text_encoder", "text_encoder_2", "image_encoder", "vae")
    }
    text = counts["text_encoder"] + counts["text_encoder_2"]  # a known encoder's blocks, or only its size
    known = next(
        (k for k in known_text_encoders() if k.params == text), TextEncoders(text, whole=counts["text_encoder_2"])
    )
    pipeline = {**adapter.PIPELINE_DEFAULTS, **folder_defaults(path, adapter)}
    text_len = pipeline.get("max_text_len", Defaults.max_text_len)
    try:
        shape = adapter.shape_of(str(path), config, info.transformer_params, text_len, (t, s, s))
        image_tokens = vision_tokens(_json_object(path / "image_encoder" / "config.json"))
        shape = with_components(
            shape, adapter, config, variant, known, counts["image_encoder"], image_tokens, vae_config, counts["vae"]
        )
    except (TypeError, ValueError) as exc:  # a value of the wrong type in the user's config
        raise ModelDirError(f"{path}/transformer/config.json: a value is not what diffusers expects ({exc})") from None
    defaults = replace(geometry_of(adapter, config, shape, variant, (t, s)), **pipeline)
    return ModelSpec(
        str(path), "local diffusers-format directory", shape, defaults, variant=variant, family=info.family
    )


def folder_defaults(path: Path, adapter) -> dict:
    """The generation defaults `path`'s own config files set (the family's `FOLDER_DEFAULTS`):
    {Defaults field: value}; a value of the wrong type is a one-line ModelDirError."""
    found = {}
    for entry in adapter.FOLDER_DEFAULTS:
        value = _json_object(path / entry.file).get(entry.key)
        if value is None:
            continue
        kinds = (int, float) if entry.kind is float else (entry.kind,)
        if isinstance(value, bool) or not isinstance(value, kinds) or (entry.kind is not str and value <= 0):
            raise ModelDirError(
                f"{path / entry.file}: {entry.key} must be a positive {entry.kind.__name__}, got {value!r}"
            )
        if entry.derive is None:
            found[entry.default] = entry.kind(value)
        else:
            found.update(entry.derive(entry.kind(value), path))
    return found


def vision_tokens(config: dict) -> int:
    """Tokens a ViT image encoder gives (patches and the class token); 0 without one."""
    vision = config.get("vision_config", config)  # a CLIPModel nests it
    size, patch = vision.get("image_size"), vision.get("patch_size")
    if not (isinstance(size, int) and isinstance(patch, int) and 0 < patch <= size):
        return 0
    return (size // patch) ** 2 + 1


def _json_object(file: Path) -> dict:
    """A config file's object; {} where it is absent or unreadable (checked where the model is inspected)."""
    from basics.user_files import read_json_file

    try:
        config = read_json_file(file, "model file")
    except (OSError, ConfigError):
        return {}
    return config if isinstance(config, dict) else {}
