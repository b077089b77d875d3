"""Load a resolved model's components onto a device, in the requested dtype."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from planner.errors import ConfigError
from runtime.errors import ModelDirError
from runtime.models.registry import ResolvedModel

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


def _dtype_kwarg() -> str:
    # diffusers renamed `torch_dtype` to `dtype` (0.36+); older releases only know the former.
    try:
        from diffusers.utils import deprecation_utils

        return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    except ImportError:
        return "torch_dtype"


def load_components(model: ResolvedModel, placement: Placement, on_cpu: tuple[str, ...] = ()) -> dict:
    """Return {tokenizer, text_encoder, transformer[, transformer_2], vae, scheduler[,
    image_encoder, image_processor]} ready for inference, through the diffusers pipeline class
    the directory names (the spec's variant).

    The VAE and the CLIP image encoder are kept in float32 (as Wan's reference code and
    diffusers' examples do); the text encoder and transformers take `placement.dtype`, with
    the float32 modules diffusers/transformers keep when loading. The built-in model is a
    directory shipped in the package, loaded through the same path as a user checkpoint.
    `on_cpu`: components left on the CPU (sharded first, then moved: runtime/weights.py).
    """
    import diffusers

    check_torch()
    path = model.path
    pipeline_class = getattr(diffusers, model.spec.variant.pipeline)
    dtypes = {"default": placement.dtype, "vae": torch.float32, "image_encoder": torch.float32}
    try:
        pipe = pipeline_class.from_pretrained(
            str(path), local_files_only=True, use_safetensors=True, **{_dtype_kwarg(): dtypes}
        )
        components = {k: v for k, v in pipe.components.items() if v is not None}
        for name in ("text_encoder", "transformer", "transformer_2", "vae", "image_encoder"):
            if name not in components:
                continue
            # Device only: a dtype cast here would undo the float32 modules kept by from_pretrained.
            device = torch.device("cpu") if name in on_cpu else placement.device
            components[name].to(device).eval().requires_grad_(False)
    except Exception as exc:  # diffusers/transformers raise many types for a broken directory
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelDirError(f"cannot load the model from {path}: {type(exc).__name__}: {first}") from exc
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
