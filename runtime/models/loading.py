"""Load a resolved model's components onto a device, in the requested dtype."""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from basics.errors import ConfigError
from basics.user_files import read_json_file
from runtime.errors import ModelDirError
from runtime.models.checkpoint import LIBRARIES, WEIGHTED
from runtime.models.families import family_classes, find_class
from runtime.models.hub import hub_offline
from runtime.models.resolve import ResolvedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The oldest torch the runtime works with (pyproject.toml says the same): FSDP2's
# fully_shard(ignored_params=) for --shard-weights and parallelize_module(src_data_rank=) for
# --parallel tp first came in 2.7.
MIN_TORCH = (2, 7)


def check_torch() -> None:
    """A one-line ConfigError on a torch older than MIN_TORCH (an environment made without pip's
    resolver, or a compute node's own), before any model is loaded. By major.minor only: NGC's
    containers ship pre-releases such as 2.7.0a0+<commit>.nv25.04."""
    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if found is None or (int(found[1]), int(found[2])) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ConfigError(
            f"ditango needs torch >= {need}, this environment has {torch.__version__}; "
            f"install a newer build (pip install 'torch>={need}' from your CUDA's index)"
        )


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype  # text encoder and transformer; the VAE always runs in float32

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_placement(device: str = "auto", dtype: str | None = None) -> Placement:
    """`auto` picks CUDA when available here; the default dtype is float32 on CPU, bfloat16 on CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        if not (torch.version.cuda or torch.version.hip):
            raise ConfigError(
                f"--device cuda: this environment's torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                "build (./scripts/setup.sh --cuda, or pip install torch --index-url "
                "https://download.pytorch.org/whl/cu128), or use --device cpu or auto"
            )
        raise ConfigError("--device cuda requested but no CUDA device is available; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device!r}")
    return placement_on(torch.device(device), dtype)


def placement_on(device: torch.device, dtype: str | None = None) -> Placement:
    """The placement on a device the launcher chose (a rank's own GPU, or the CPU)."""
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return Placement(device, DTYPES[dtype])


def _dtype_kwarg(cls: type) -> str:
    """The name `cls.from_pretrained` takes the dtype by: both libraries renamed `torch_dtype`
    to `dtype` (transformers 4.56, diffusers 0.36), and older releases only know the former."""
    if cls.__module__.startswith("transformers"):
        import transformers

        found = re.match(r"(\d+)\.(\d+)", transformers.__version__)
        return "dtype" if found and (int(found[1]), int(found[2])) >= (4, 56) else "torch_dtype"
    try:
        from diffusers.utils import deprecation_utils

        return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    except ImportError:
        return "torch_dtype"


# The components that are torch modules, each read by its own class (the rest: the pipeline's).
MODULES = WEIGHTED
FLOAT32 = ("vae", "image_encoder", "audio_vae", "vocoder")  # as Wan's reference code and diffusers' examples run them


def module_classes(path: Path) -> dict[str, type]:
    """{component: its class} of the torch modules model_index.json lists (`[library, class]`;
    `[null, null]`: absent, as Wan2.1's transformer_2)."""
    index = read_json_file(path / "model_index.json", "model file")
    classes = {}
    for name in MODULES:
        entry = index.get(name)
        if isinstance(entry, list) and len(entry) == 2 and None not in entry:
            own = family_classes().get(entry[1])  # a registered family's own class
            if own is None and entry[0] not in LIBRARIES:  # the file is the user's: import nothing else by its word
                raise ModelDirError(
                    f"{path}/model_index.json: {name} comes from {entry[0]!r}, not one of {', '.join(LIBRARIES)}"
                )
            classes[name] = own or getattr(importlib.import_module(entry[0]), entry[1])
    return classes


@contextlib.contextmanager
def _unverifiable_quiet():
    """diffusers warns, with the module's whole repr, that it cannot check the type of a module
    passed in from a pipeline's own package (LTX-2's connectors and vocoder): `module_classes`
    read each by the class model_index.json names, so the warning says nothing here."""
    logger = logging.getLogger("diffusers.pipelines.pipeline_loading_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@hub_offline()  # a local directory only: a rank never downloads (runtime/models/hub.py)
def load_components(model: ResolvedModel, placement: Placement, on_cpu: tuple[str, ...] = (), adapter_sets=()) -> dict:
    """Return {tokenizer, text_encoder, transformer[, transformer_2], vae, scheduler[,
    image_encoder, image_processor]} ready for inference, through the diffusers pipeline class
    the directory names (the spec's variant).

    Each module is read by its own class's from_pretrained straight into its dtype and onto
    its device (`device_map`, meta-device init: no float32 copy, and on a GPU no copy of the
    model in host memory; what the host holds is the safetensors file being read, mapped),
    then handed to the pipeline class, which loads the rest (tokenizer, scheduler). The VAE and
    the CLIP image encoder are kept in float32; the text encoder and transformers take
    `placement.dtype`, with the float32 modules diffusers/transformers keep when loading
    (`_keep_in_fp32_modules`). `adapter_sets`: the run's LoRA sets, loaded by the pipeline
    (runtime/models/adapters.py; under "adapters", an `AdapterBank`). The built-in model is a
    directory shipped in the package, loaded through the same path as a user checkpoint. `on_cpu`: components read onto the CPU (in
    their dtype), sharded or split there first, then moved (runtime/weights.py).
    """

    check_torch()
    path = model.path
    pipeline_class = find_class(model.spec.variant.pipeline)
    common = {"local_files_only": True, "use_safetensors": True}
    try:
        modules = {}
        for name, cls in module_classes(path).items():
            device = torch.device("cpu") if name in on_cpu else placement.device
            dtype = torch.float32 if name in FLOAT32 else placement.dtype
            module = cls.from_pretrained(
                str(path),
                subfolder=name,
                low_cpu_mem_usage=True,
                device_map={"": device},
                **common,
                **{_dtype_kwarg(cls): dtype},
            )
            # One device: no dispatch hooks, but the map would make later moves (offload, FSDP) suspect.
            vars(module).pop("hf_device_map", None)
            modules[name] = module.eval().requires_grad_(False)
        with _unverifiable_quiet():
            pipe = pipeline_class.from_pretrained(str(path), **common, **modules)
        components = {k: v for k, v in pipe.components.items() if v is not None}
    except Exception as exc:  # diffusers/transformers raise many types for a broken directory
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelDirError(f"cannot load the model from {path}: {type(exc).__name__}: {first}") from exc
    if any(adapter_sets):
        from runtime.models.adapters import AdapterBank

        components["adapters"] = AdapterBank(pipe, list(adapter_sets))
    return components


def quiet_loading_bars() -> None:
    """The CLI's progress bar is the only one: hide diffusers'/transformers' loading bars."""
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def human_count(n: int) -> str:
    """14288491584 -> '14.3B' (parameter counts in tables)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
