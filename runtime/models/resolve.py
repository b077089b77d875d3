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
from planner.models import ModelShape
from runtime.errors import ModelDirError
from runtime.models import hub
from runtime.models.checkpoint import ModelDirInfo, count_params, inspect_model_dir
from runtime.models.families import FAMILIES
from runtime.models.hub import MODEL_ROOT_ENV, model_root
from runtime.models.registry import BUILTIN_DIR, REGISTRY, TEXT_ENCODERS, Defaults, ModelSpec, with_components


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
    return ResolvedModel(found if spec is None else replace(spec, variant=info.variant), path)


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
    ):
        if a != b:
            return f"{what} {b!r} where {spec.name} has {a!r}"
    return None


def spec_from_dir(path: Path, info: ModelDirInfo) -> ModelSpec:
    """A spec for a user-supplied directory: diffusers' pipeline defaults, shapes from its
    transformer config (through the adapter), what it asks for from its model_index.json."""
    config, variant = info.transformer_config, info.variant
    stride = vae_stride(path)
    adapter = FAMILIES[info.family]

    def components(shape: ModelShape) -> ModelShape:
        counts = {
            n: count_params(sorted((path / n).glob("*.safetensors"))) if (path / n).is_dir() else 0
            for n in ("text_encoder", "text_encoder_2", "image_encoder", "vae")
        }
        text = counts["text_encoder"] + counts["text_encoder_2"]  # a known encoder's blocks, or only its size
        known = next((t for t in TEXT_ENCODERS.values() if t[0] == text), (text, 0, 0, counts["text_encoder_2"]))
        return with_components(
            shape, adapter, config, variant, known, counts["image_encoder"], _vae_config(path), counts["vae"]
        )

    pipeline = adapter.PIPELINE_DEFAULTS  # the pipeline's defaults where they differ from `Defaults`
    text_len = pipeline.get("max_text_len", Defaults.max_text_len)
    try:
        shape = components(adapter.shape_of(str(path), config, info.transformer_params, text_len, (4, stride, stride)))
    except (TypeError, ValueError) as exc:  # a value of the wrong type in the user's config
        raise ModelDirError(f"{path}/transformer/config.json: a value is not what diffusers expects ({exc})") from None
    defaults = Defaults(
        vae_stride=stride,
        patch=shape.patch,
        rope_max_seq_len=int(config.get("rope_max_seq_len", 1024)),
        image=variant.image,
        experts=variant.experts,
        **pipeline,
    )
    return ModelSpec(
        str(path), "local diffusers-format directory", shape, defaults, variant=variant, family=info.family
    )


def _vae_config(path: Path) -> dict:
    from basics.user_files import read_json_file

    try:
        config = read_json_file(path / "vae" / "config.json", "model file")
    except (OSError, ConfigError):  # checked where the model is inspected; here a default
        return {}
    return config if isinstance(config, dict) else {}


def vae_stride(path: Path) -> int:
    """Spatial compression of a directory's Wan VAE (diffusers' `scale_factor_spatial`, default 8)."""
    stride = _vae_config(path).get("scale_factor_spatial")  # what WanPipeline sizes its latents by
    return int(stride) if isinstance(stride, int) and stride > 0 else Defaults.vae_stride
