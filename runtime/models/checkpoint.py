"""Validation of a diffusers-format model directory before anything is loaded.

What a directory asks for (pipeline class, components, model_index.json keys) is checked
against what its family honours (runtime/models/<family>/checkpoint.py); the rest is refused
by name.

Local files only, safetensors only: pickle-based weights (.bin, .pt, .pth, .ckpt, .pkl)
can execute code when loaded, so a directory that only has those is refused with a
message saying how to convert it, and every weight file is read as safetensors by its
content before anything loads it (runtime/models/weight_files.py): a pickle named
`.safetensors` is refused too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import read_json_file
from runtime.errors import ModelDirError
from runtime.models.families import FAMILIES, family_classes
from runtime.models.wan import WanVariant
from runtime.models.weight_files import PICKLE_SUFFIXES, tensor_shapes

LIBRARIES = ("diffusers", "transformers")  # where a model_index.json's classes may come from
# Components that carry weights, and the config file diffusers/transformers expect in each.
WEIGHTED = (
    "transformer",
    "transformer_2",
    "text_encoder",
    "text_encoder_2",
    "vae",
    "image_encoder",
    "connectors",
    "audio_vae",
    "vocoder",
)


@dataclass(frozen=True)
class ModelDirInfo:
    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]  # name -> (library, class)
    transformer_config: dict
    transformer_params: int  # of all experts together
    variant: WanVariant = WanVariant()
    family: str = "wan"  # its key in runtime/models/families.py


def _read_json(path: Path) -> dict:
    try:
        data = read_json_file(path, "model file")
    except FileNotFoundError:
        raise ModelDirError(f"model directory is incomplete: {path} is missing") from None
    except ConfigError as exc:
        raise ModelDirError(str(exc)) from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} is not a JSON object")
    return data


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# The weights' file name each library's from_pretrained loads (a sharded one: its index's).
WEIGHTS_NAMES = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}


def _check_weights(folder: Path, name: str, library: str) -> list[Path]:
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
    wanted = WEIGHTS_NAMES[library]
    if files and not ((folder / wanted).is_file() or (folder / f"{wanted}.index.json").is_file()):
        raise ModelDirError(
            f"{folder} has {', '.join(f.name for f in files[:3])} but no {wanted} (or its .index.json), the name "
            f"{library} loads a {name} from; rename the file"
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
    """Parameter count from safetensors headers (no tensor data is read); a file that is not
    safetensors by its content is a ModelDirError."""
    total = 0
    for file in files:
        for shape in tensor_shapes(file, "weight file", ModelDirError).values():
            n = 1
            for dim in shape:
                n *= dim
            total += n
    return total


def _refuse_unhonoured(path: Path, components: dict[str, tuple[str, str]], honoured: dict) -> None:
    """A directory asking for what the runtime does not do is refused, naming it: never run as
    a model it is not (the video would be wrong without a word). `honoured`: the family's
    components, each with the classes it runs there (None: any)."""
    extra = [name for name in components if name not in honoured]
    if extra:
        raise ModelDirError(f"{path}/model_index.json has component(s) {', '.join(extra)} that ditango does not run")
    for name, classes in honoured.items():
        if classes is not None and name in components and components[name][1] not in classes:
            raise ModelDirError(
                f"{path}: component {name} is a {components[name][1]}; ditango runs a {' or '.join(classes)} there"
            )


def _refuse_unknown_classes(path: Path, components: dict[str, tuple[str, str]]) -> None:
    """Every component's class is one the installed diffusers or transformers has, or one a
    registered family brings: the file is the user's, so nothing else is imported by its word,
    and a class this environment lacks is said here (by `check` too), not met while loading."""
    own = family_classes()
    for name, (library, cls) in components.items():
        if cls in own:
            continue
        if library not in LIBRARIES:
            raise ModelDirError(
                f"{path}/model_index.json: {name} comes from {library!r}, not one of {', '.join(LIBRARIES)}"
            )
        module = importlib.import_module(library)
        if not hasattr(module, cls):
            raise ModelDirError(
                f"{path}/model_index.json: {name} is a {library}.{cls}, which {library} "
                f"{module.__version__} does not have"
            )


def _saved_by(library: str, cls: str) -> str:
    """The library whose file names a component's weights take: a family's own class saves as
    the library it derives from (a diffusers ModelMixin, else a transformers model)."""
    own = family_classes().get(cls)
    if own is None:
        return library
    from diffusers import ModelMixin

    return "diffusers" if issubclass(own, ModelMixin) else "transformers"


def family_of_pipeline(pipeline_class: str) -> str | None:
    """The family (its key) whose checkpoints name this diffusers pipeline, None if none does."""
    return next((name for name, f in FAMILIES.items() if pipeline_class in f.PIPELINES), None)


def inspect_model_dir(path: Path) -> ModelDirInfo:
    """Check that `path` is a complete diffusers-format directory of a family this tool runs,
    with safetensors weights."""
    path = Path(path)
    index = _read_json(path / "model_index.json")
    pipeline_class = index.get("_class_name", "")
    family_name = family_of_pipeline(pipeline_class)
    if family_name is None:
        supported = ", ".join(p for f in FAMILIES.values() for p in f.PIPELINES)
        raise ModelDirError(f"{path}/model_index.json names pipeline {pipeline_class!r}; supported: {supported}")
    family = FAMILIES[family_name]
    components: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue
        components[name] = (str(value[0]), str(value[1]))
    missing = [name for name in family.REQUIRED if name not in components]
    if missing:
        raise ModelDirError(f"{path}/model_index.json lists no {', '.join(missing)} component")
    _refuse_unhonoured(path, components, family.COMPONENTS)
    _refuse_unknown_classes(path, components)
    for name in components:
        folder = path / name
        if not folder.is_dir():
            raise ModelDirError(f"model directory is incomplete: component folder {folder} is missing")
    configs = {name: _read_json(path / name / "config.json") for name in WEIGHTED if name in components}
    variant = family.dir_variant(path, index, components, configs)  # what it asks for, before its files
    weights = {
        name: _check_weights(path / name, name, _saved_by(*components[name])) for name in WEIGHTED if name in components
    }
    params = {name: count_params(files) for name, files in weights.items()}  # every header read: no pickle inside
    _read_json(path / "scheduler" / "scheduler_config.json")
    for tokenizer in [n for n in ("tokenizer", "tokenizer_2") if n in components]:
        if not any((path / tokenizer).iterdir()):
            raise ModelDirError(f"model directory is incomplete: {path / tokenizer} is empty")
    return ModelDirInfo(
        path=path,
        pipeline_class=pipeline_class,
        components=components,
        transformer_config=configs["transformer"],
        transformer_params=params.get("transformer", 0) + params.get("transformer_2", 0),
        variant=variant,
        family=family_name,
    )
