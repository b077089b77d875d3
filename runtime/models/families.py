"""Model families: one package per family, each implementing `Family`; a new family is one
package under runtime/models/ and one entry in FAMILIES.

Nothing outside runtime/models/ names a family: the runtime finds a component's family by its
class (`family_of`, `family_of_vae`) and asks it, and the planner reads what a family's shape
functions put into `ModelShape` and `VaeShape`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.models import hunyuan, wan


class FamilyModel(Protocol):
    """A loaded checkpoint of the family, as the denoising loop (runtime/denoiser.py) drives it."""

    transformers: list  # one per expert, in the order the schedule switches to them
    vae: torch.nn.Module
    device: torch.device

    def text_encoders(self) -> list: ...
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float, embedded: float | None = None): ...
    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor: ...
    def encode_image(self, image, latents_BCFHW: torch.Tensor, height: int, width: int, frames: int): ...
    def new_scheduler(self, steps: int): ...
    def experts(self, timesteps: list[float], num_train_timesteps: int) -> list[int]: ...
    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text, condition) -> torch.Tensor: ...
    def final_latents(self, latents_BCFHW: torch.Tensor, condition) -> torch.Tensor: ...
    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor: ...
    def postprocess(self, video_BCFHW: torch.Tensor): ...


class Family(Protocol):
    """What each family package provides (runtime/models/wan/ is the model).

    - naming: TRANSFORMER_CLASS, VAE_CLASS (diffusers' class names it loads);
    - shapes for the registry, the memory model and the cost model: shape_of, block_params,
      vae_shape_of, count_params;
    - the loop: load_model(components, device, max_text_len, variant) -> FamilyModel;
    - the VAE's decode: vae_chunks, decode_tile, join_chunks (runtime/vae.py tiles and spreads it);
    - parallelism, installed on a built model: install/uninstall (context parallel: where tokens
      are sharded, which modules attend, where the output is gathered), install_tp/uninstall_tp,
      attention_shape, patch_size;
    - Hybridiff's segments and the step cache's probes: segment_blocks, pack_boundary,
      from_block, probes.
    """

    TRANSFORMER_CLASS: str
    VAE_CLASS: str

    def load_model(self, components: dict, device: torch.device, max_text_len: int, variant=None) -> FamilyModel: ...
    def install(self, transformer, ctx) -> tuple[list, list]: ...
    def uninstall(self, transformer, handles: list, replaced: list) -> None: ...
    def install_tp(self, transformer, tp) -> tuple[list, list]: ...
    def uninstall_tp(self, transformer, handles: list, undo: list) -> None: ...
    def attention_shape(self, transformer) -> tuple[int, int, int]: ...
    def patch_size(self, transformer) -> tuple[int, int, int]: ...
    def probes(self, transformer) -> list[tuple]: ...
    def vae_chunks(self, vae, frames: int) -> list[slice]: ...
    def decode_tile(self, vae, z_BCFHW: torch.Tensor) -> torch.Tensor: ...
    def join_chunks(self, vae, chunks: list[torch.Tensor], frames: int) -> torch.Tensor: ...


FAMILIES: dict[str, Family] = {"wan": wan, "hunyuanvideo": hunyuan}


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
