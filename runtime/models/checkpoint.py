"""Validation of a diffusers-format model directory before anything is loaded.

What a directory asks for (pipeline class, components, model_index.json keys) is checked
against what the Wan adapter honours; the rest is refused by name.

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
from runtime.models import wan

# What of a Wan directory this tool honours (runtime/models/wan.py): these pipelines, these
# components with these classes, and these model_index.json keys. Anything else would change
# what the pipeline computes, so it is refused by name rather than loaded and ignored.
SUPPORTED_PIPELINES = (*wan.PIPELINES, "HunyuanVideoPipeline")
# HunyuanVideo (runtime/models/hunyuan.py): text-to-video; its components and their classes.
HUNYUAN_REQUIRED = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2")
HUNYUAN_CLASSES = {
    "transformer": ("HunyuanVideoTransformer3DModel",),
    "vae": ("AutoencoderKLHunyuanVideo",),
    "text_encoder": ("LlamaModel",),
    "text_encoder_2": ("CLIPTextModel",),
}
HONOURED_CLASSES = {
    "transformer": (wan.TRANSFORMER_CLASS,),
    "transformer_2": (wan.TRANSFORMER_CLASS,),
    "vae": (wan.VAE_CLASS,),
    "image_encoder": wan.IMAGE_ENCODER_CLASSES,
    "image_processor": wan.IMAGE_PROCESSOR_CLASSES,
}
OPTIONAL = ("tokenizer", "text_encoder", "transformer", "transformer_2", "vae", "scheduler", "image_encoder",
            "image_processor")  # fmt: skip
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Components that carry weights, and the config file diffusers/transformers expect in each.
WEIGHTED = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "vae", "image_encoder")
REQUIRED = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")


@dataclass(frozen=True)
class ModelDirInfo:
    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]  # name -> (library, class)
    transformer_config: dict
    transformer_params: int  # of all experts together
    variant: wan.WanVariant = wan.WanVariant()
    family: str = "wan"  # or "hunyuanvideo"


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
    a model it is not (the video would be wrong without a word)."""
    extra = [name for name in components if name not in OPTIONAL]
    if extra:
        raise ModelDirError(f"{path}/model_index.json has component(s) {', '.join(extra)} that ditango does not run")
    for name, classes in HONOURED_CLASSES.items():
        if name in components and components[name][1] not in classes:
            raise ModelDirError(
                f"{path}: component {name} is a {components[name][1]}; ditango runs a {' or '.join(classes)} there"
            )


def _refuse_other_classes(path: Path, components: dict, allowed: tuple, classes: dict) -> None:
    extra = [name for name in components if name not in allowed]
    if extra:
        raise ModelDirError(f"{path}/model_index.json has component(s) {', '.join(extra)} that ditango does not run")
    for name, want in classes.items():
        if components[name][1] not in want:
            raise ModelDirError(f"{path}: component {name} is a {components[name][1]}; ditango runs a {want[0]} there")


def _variant(path: Path, index: dict, components: dict, config: dict, config_2: dict | None) -> wan.WanVariant:
    """What the directory asks of the denoising loop, checked for consistency."""
    where = f"{path}/model_index.json"
    ratio, expand = index.get("boundary_ratio"), index.get("expand_timesteps", False)
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
        raise ModelDirError(f"{where}: boundary_ratio must be a number in (0, 1), got {ratio!r}")
    if not isinstance(expand, bool):
        raise ModelDirError(f"{where}: expand_timesteps must be true or false, got {expand!r}")
    if (ratio is None) != (config_2 is None):
        what = "a second expert (transformer_2) but no boundary_ratio" if ratio is None else (
            f"boundary_ratio {ratio} but no second expert (transformer_2)")  # fmt: skip
        raise ModelDirError(f"{where} has {what}: diffusers would not run both experts; ditango refuses it")
    if config_2 is not None and (differ := wan.same_architecture(config, config_2)):
        raise ModelDirError(f"{path}: transformer and transformer_2 differ in {', '.join(differ)}; ditango needs "
                            "experts of one architecture")  # fmt: skip
    pipeline = index["_class_name"]
    wants_image = config.get("image_dim") is not None
    if wants_image and "image_encoder" not in components:
        raise ModelDirError(
            f"{path}: the transformer takes CLIP image embeddings (image_dim) but there is no image_encoder"
        )
    if pipeline == "WanPipeline" and ("image_encoder" in components or wants_image):
        raise ModelDirError(f"{where}: a WanPipeline with an image encoder; image-to-video is WanImageToVideoPipeline")
    if wants_image and "image_processor" not in components:
        raise ModelDirError(f"{where} lists an image_encoder but no image_processor")
    if pipeline == "WanImageToVideoPipeline" and not expand and config.get("in_channels") == config.get("out_channels"):
        raise ModelDirError(f"{path}: a WanImageToVideoPipeline whose transformer takes no condition channels "
                            f"(in_channels = out_channels = {config.get('in_channels')})")  # fmt: skip
    return wan.WanVariant(
        pipeline=pipeline, boundary_ratio=None if ratio is None else float(ratio), expand_timesteps=expand,
        image_encoder="image_encoder" in components,
    )  # fmt: skip


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
    hunyuan = pipeline_class == "HunyuanVideoPipeline"
    missing = [name for name in (HUNYUAN_REQUIRED if hunyuan else REQUIRED) if name not in components]
    if missing:
        raise ModelDirError(f"{path}/model_index.json lists no {', '.join(missing)} component")
    if hunyuan:
        _refuse_other_classes(path, components, HUNYUAN_REQUIRED, HUNYUAN_CLASSES)
    else:
        _refuse_unhonoured(path, index, components)
    for name in components:
        folder = path / name
        if not folder.is_dir():
            raise ModelDirError(f"model directory is incomplete: component folder {folder} is missing")
    configs = {name: _read_json(path / name / "config.json") for name in WEIGHTED if name in components}
    weights = {name: _check_weights(path / name, name) for name in WEIGHTED if name in components}
    _read_json(path / "scheduler" / "scheduler_config.json")
    for tokenizer in [n for n in ("tokenizer", "tokenizer_2") if n in components]:
        if not any((path / tokenizer).iterdir()):
            raise ModelDirError(f"model directory is incomplete: {path / tokenizer} is empty")
    if hunyuan:
        condition = configs["transformer"].get("image_condition_type")
        if condition is not None:
            raise ModelDirError(f"{path}: HunyuanVideo image conditioning ({condition}) is not supported")
        variant = wan.WanVariant(pipeline=pipeline_class)
    else:
        variant = _variant(path, index, components, configs["transformer"], configs.get("transformer_2"))
    return ModelDirInfo(
        path=path,
        pipeline_class=pipeline_class,
        components=components,
        transformer_config=configs["transformer"],
        transformer_params=sum(count_params(weights[n]) for n in ("transformer", "transformer_2") if n in weights),
        variant=variant,
        family="hunyuanvideo" if hunyuan else "wan",
    )
