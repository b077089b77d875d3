"""Model families: one package per family, each implementing `Family`. The built-in ones are
FAMILIES' entries; another is registered (`runtime.models.registry.register_family`) from its
own module, named in $DITANGO_FAMILIES or in the `ditango.families` entry points, so every rank
and every Slurm task loads it too: adding a family edits nothing outside its package.

Nothing outside runtime/models/ names a family: the runtime finds a component's family by its
class (`family_of`, `family_of_vae`) and asks it, and the planner reads what a family's shape
functions put into `ModelShape` and `VaeShape`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.models import hunyuan, hunyuan15, ltx2, skyreels, wan
from runtime.models.protocol import FolderDefault, NamedModel, Tiling


class FamilyModel(Protocol):
    """A loaded checkpoint of the family, as the denoising loop (runtime/denoiser.py) drives it."""

    transformers: list  # one per expert, in the order the schedule switches to them
    vae: torch.nn.Module
    device: torch.device

    def text_encoders(self) -> list: ...
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float, **options): ...
    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor: ...
    def encode_image(self, image, latents_BCFHW: torch.Tensor, height: int, width: int, frames: int): ...
    def new_scheduler(self, steps: int, sampler=None, latents_BCFHW=None): ...
    def experts(self, timesteps: list[float], num_train_timesteps: int) -> list[int]: ...
    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text, condition) -> torch.Tensor: ...
    def final_latents(self, latents_BCFHW: torch.Tensor, condition) -> torch.Tensor: ...
    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor: ...
    def postprocess(self, video_BCFHW: torch.Tensor): ...


class Family(Protocol):
    """What each family package provides (runtime/models/wan/ is the model); its loaded model
    (`FamilyModel`) lives in the package's `loop` module.

    - naming: TRANSFORMER_CLASS, VAE_CLASS, PIPELINES (the class names it runs: diffusers', or
      its own, which an optional CLASSES {name: class} brings);
    - its named models (MODELS: `protocol.NamedModel`, read by the registry, the planner and
      the CLI); the VAE's (time, space) compression from its config (vae_strides: frames are
      time x k + 1, sizes multiples of space x patch); the positions the rotary covers
      (rope_max_seq_len); FOLDER_DEFAULTS (`protocol.FolderDefault`: defaults a model folder's
      own configs set, read over PIPELINE_DEFAULTS);
    - checkpoint directories: COMPONENTS (name -> the classes honoured there), REQUIRED,
      dir_variant (what a directory asks of the loop, checked); named_parts (the public
      checkpoints' other components, built without weights);
    - shapes for the registry, the memory model and the cost model: shape_of, block_params,
      blocks_params, fsdp_gathered_params, vae_shape_of, count_params, PIPELINE_DEFAULTS;
    - the loop: load_model(components, device, max_text_len, variant) -> FamilyModel,
      expert_schedule (which expert runs each step), and SCHEDULE_BY_SIGMAS (the loop sets the
      schedule's sigmas: only solvers that take them apply, runtime/models/schedulers.py);
    - the VAE's decode: tiling (how to cut it, `protocol.Tiling`), vae_chunks, decode_tile,
      join_chunks (runtime/vae.py tiles and spreads it);
    - parallelism, installed on a built model: install/uninstall (context parallel: where tokens
      are sharded, which modules attend, where the output is gathered), install_tp/uninstall_tp,
      attention_shape, patch_size;
    - Hybridiff's segments and the step cache's probes: segment_blocks, pack_boundary,
      from_block, probes.
    """

    TRANSFORMER_CLASS: str
    VAE_CLASS: str
    PIPELINES: tuple[str, ...]
    COMPONENTS: dict[str, tuple[str, ...] | None]
    REQUIRED: tuple[str, ...]
    PIPELINE_DEFAULTS: dict
    FOLDER_DEFAULTS: tuple[FolderDefault, ...]
    MODELS: tuple[NamedModel, ...]
    SCHEDULE_BY_SIGMAS: bool

    def dir_variant(self, path, index: dict, components: dict, configs: dict): ...
    def named_parts(self, transformer_config: dict, vae_config: dict, variant) -> dict: ...
    def shape_of(self, name: str, config: dict, params: int, text_len: int, vae_stride: tuple[int, int, int]): ...
    def block_params(self, config: dict) -> int: ...
    def blocks_params(self, config: dict) -> int: ...
    def fsdp_gathered_params(self, config: dict, hidden: int, layers: int) -> int: ...
    def vae_shape_of(self, config: dict, params: int): ...
    def vae_strides(self, config: dict) -> tuple[int, int]: ...
    def rope_max_seq_len(self, config: dict) -> int: ...
    def tiling(self, vae, tiled: bool, px: int | None) -> Tiling: ...
    def count_params(self, config: dict) -> int: ...
    def expert_schedule(self, variant, timesteps: list[float], num_train_timesteps: int) -> list[int]: ...
    def load_model(self, components: dict, device: torch.device, max_text_len: int, variant=None) -> FamilyModel: ...
    def vae_chunks(self, vae, frames: int) -> list[slice]: ...
    def decode_tile(self, vae, z_BCFHW: torch.Tensor) -> torch.Tensor: ...
    def join_chunks(self, vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor: ...
    def install(self, transformer, ctx) -> tuple[list, list]: ...
    def uninstall(self, transformer, handles: list, replaced: list) -> None: ...
    def install_tp(self, transformer, tp) -> tuple[list, list]: ...
    def uninstall_tp(self, transformer, handles: list, undo: list) -> None: ...
    def attention_shape(self, transformer) -> tuple[int, int, int]: ...
    def patch_size(self, transformer) -> tuple[int, int, int]: ...
    def segment_blocks(self, transformer) -> list: ...
    def pack_boundary(self, output) -> torch.Tensor: ...
    def from_block(self, transformer, split: int, boundary: torch.Tensor): ...
    def probes(self, transformer) -> list[tuple]: ...


FAMILIES: dict[str, Family] = {
    "wan": wan,
    "hunyuanvideo": hunyuan,
    "hunyuanvideo-1.5": hunyuan15,
    "skyreels-v2": skyreels,
    "ltx-2": ltx2,
}
# Everything a family provides: its constants and functions (`check_family` asks for each).
MEMBERS = tuple(sorted({*Family.__annotations__, *(n for n in vars(Family) if not n.startswith("_"))}))


def check_family(key: str, family) -> None:
    """A one-line error unless `family` has every member of the protocol and claims no class
    or pipeline another family runs (components are found by their class)."""
    missing = [m for m in MEMBERS if not hasattr(family, m)]
    if missing:
        raise TypeError(f"model family {key!r} lacks {', '.join(missing)} (runtime/models/families.py Family)")
    for other_key, other in FAMILIES.items():
        if other_key == key:
            continue
        shared = {family.TRANSFORMER_CLASS, *family.PIPELINES} & {other.TRANSFORMER_CLASS, *other.PIPELINES}
        if shared:
            raise ValueError(
                f"model family {key!r} claims {', '.join(sorted(shared))}, which family {other_key!r} runs"
            )


def family_classes() -> dict[str, type]:
    """The classes registered families bring (their optional `CLASSES`: a model whose code is
    not in diffusers), by name."""
    return {name: cls for f in FAMILIES.values() for name, cls in getattr(f, "CLASSES", {}).items()}


def find_class(name: str, libraries: tuple[str, ...] = ("diffusers", "transformers")):
    """The class a model folder names: one a registered family brings, else diffusers' or
    transformers' (None: none has it). Nothing is imported by a file's word."""
    import importlib

    own = family_classes().get(name)
    if own is not None:
        return own
    for library in libraries:
        cls = getattr(importlib.import_module(library), name, None)
        if cls is not None:
            return cls
    return None


def _by_class(obj, attr: str) -> Family:
    # By the class or a base of it: FSDP2 (--shard-weights) makes an FSDP<Name> subclass.
    names = {getattr(f, attr): f for f in FAMILIES.values()}
    for cls in type(obj).__mro__:
        if cls.__name__ in names:
            return names[cls.__name__]
    raise TypeError(f"no model family for {type(obj).__name__}; known: {', '.join(names)}")


def family_of(transformer) -> Family:
    """The family of a transformer (by its diffusers class)."""
    return _by_class(transformer, "TRANSFORMER_CLASS")


def family_of_vae(vae) -> Family:
    return _by_class(vae, "VAE_CLASS")
