"""Validation of a diffusers-format model directory before anything is loaded.

Local files only, safetensors only: pickle-based weights (.bin, .pt, .pth, .ckpt, .pkl)
can execute code when loaded, so a directory that only has those is refused with a
message saying how to convert it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from runtime.errors import ModelDirError

SUPPORTED_PIPELINES = ("WanPipeline",)
# What of a WanPipeline directory this tool honours: these components, with these classes.
# Anything else changes what the pipeline computes (Wan2.2's second expert `transformer_2`
# with `boundary_ratio`, TI2V's per-token timesteps `expand_timesteps`, an image encoder), so
# it is refused by name rather than loaded and silently ignored.
HONOURED_CLASSES = {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan"}
OPTIONAL = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
UNHONOURED_KEYS = {
    "boundary_ratio": "Wan2.2's two-expert switch",
    "expand_timesteps": "Wan2.2 TI2V's per-token timesteps",
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Components that carry weights, and the config file diffusers/transformers expect in each.
WEIGHTED = {"transformer": "config.json", "text_encoder": "config.json", "vae": "config.json"}
REQUIRED = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")


@dataclass(frozen=True)
class ModelDirInfo:
    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]  # name -> (library, class)
    transformer_config: dict
    transformer_params: int


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"model directory is incomplete: {path} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} is not a JSON object")
    return data


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _check_weights(folder: Path, name: str) -> list[Path]:
    files = _safetensors_files(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    for index in indexes:  # sharded checkpoints: every shard the index names must be present
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelDirError(f"{index} has no weight_map")
        missing = sorted({str(f) for f in weight_map.values()} - {f.name for f in files})
        if missing:
            raise ModelDirError(
                f"model directory is incomplete: {folder} is missing shard {missing[0]}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                + f" named in {index.name}"
            )
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelDirError(
            f"refusing to load pickle weights {folder / pickles[0]}: only .safetensors is accepted "
            "(convert with safetensors.torch.save_file, or save_pretrained(safe_serialization=True))"
        )
    raise ModelDirError(f"model directory is incomplete: no .safetensors weights in {folder} ({name})")


def count_params(files: list[Path]) -> int:
    """Parameter count from safetensors headers (no tensor data is read)."""
    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    n = 1
                    for dim in f.get_slice(key).get_shape():
                        n *= dim
                    total += n
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelDirError(f"cannot read safetensors header of {file}: {exc}") from None
    return total


def _refuse_unhonoured(path: Path, index: dict, components: dict[str, tuple[str, str]]) -> None:
    """A directory asking for what the runtime does not do is refused, naming it: never run as
    the Wan2.1 text-to-video model it is not (the video would be wrong without a word)."""
    extra = [name for name in components if name not in OPTIONAL]
    if extra:
        raise ModelDirError(
            f"{path}/model_index.json has component(s) {', '.join(extra)} that ditango does not run "
            "(a second expert or an image encoder: Wan2.2 and image-to-video are not supported yet)"
        )
    for key, what in UNHONOURED_KEYS.items():
        if index.get(key) not in (None, False):
            raise ModelDirError(
                f"{path}/model_index.json sets {key} = {index[key]!r} ({what}), which ditango does not support yet"
            )
    for name, cls in HONOURED_CLASSES.items():
        if components[name][1] != cls:
            raise ModelDirError(f"{path}: component {name} is a {components[name][1]}; ditango runs a {cls} there")


def inspect_model_dir(path: Path) -> ModelDirInfo:
    """Check that `path` is a complete diffusers-format Wan directory with safetensors weights."""
    path = Path(path)
    index = _read_json(path / "model_index.json")
    pipeline_class = index.get("_class_name", "")
    if pipeline_class not in SUPPORTED_PIPELINES:
        raise ModelDirError(
            f"{path}/model_index.json names pipeline {pipeline_class!r}; supported: {', '.join(SUPPORTED_PIPELINES)}"
        )
    components: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue
        components[name] = (str(value[0]), str(value[1]))
    missing = [name for name in REQUIRED if name not in components]
    if missing:
        raise ModelDirError(f"{path}/model_index.json lists no {', '.join(missing)} component")
    _refuse_unhonoured(path, index, components)
    for name in components:
        folder = path / name
        if not folder.is_dir():
            raise ModelDirError(f"model directory is incomplete: component folder {folder} is missing")
    for name, config_file in WEIGHTED.items():
        _read_json(path / name / config_file)
    for name in ("text_encoder", "vae"):
        _check_weights(path / name, name)
    transformer_files = _check_weights(path / "transformer", "transformer")
    _read_json(path / "scheduler" / "scheduler_config.json")
    if not any((path / "tokenizer").iterdir()):
        raise ModelDirError(f"model directory is incomplete: {path / 'tokenizer'} is empty")
    return ModelDirInfo(
        path=path,
        pipeline_class=pipeline_class,
        components=components,
        transformer_config=_read_json(path / "transformer" / "config.json"),
        transformer_params=count_params(transformer_files),
    )
