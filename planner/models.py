"""The shape of a transformer as the planner sees it (cost model, layout checks).

Shapes are made by each model family's adapter from the transformer's config
(runtime/models/wan.py `shape_of`) and kept with the registry entries
(runtime/models/registry.py): the one source for the registry, `check` and the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.layout import token_count


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    heads: int
    head_dim: int
    ffn: int
    text_len: int
    params: int = 0  # transformer parameters, all experts together (0: not known)
    text_dim: int = 4096
    latent_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    # Text tokens take part in every self-attention (HunyuanVideo's joint attention), instead
    # of a cross-attention: `text_len` rows and keys held whole on every rank.
    joint_text: bool = False

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def out_channels(self) -> int:
        return self.latent_channels * math.prod(self.patch)

    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        t, s, _ = self.vae_stride
        return ((frames - 1) // t + 1, height // s, width // s)

    def tokens(self, height: int, width: int, frames: int) -> int:
        return token_count(self.latent_shape(height, width, frames), self.patch)
