"""One table of model shapes: what the registry (runtime/models/registry.py), the cost model
and the checks at the command line know of a transformer. A new model family adds its row here.
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
    params: int = 0  # transformer parameters (0: not known)
    text_dim: int = 4096
    latent_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)
    vae_stride: tuple[int, int, int] = (4, 8, 8)

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


# Transformer configs of the public checkpoints. HunyuanVideo (13B) is approximated as 60
# uniform blocks of its width (it has 20 dual-stream + 40 single-stream blocks).
MODELS: dict[str, ModelShape] = {
    "wan2.1-1.3b": ModelShape(
        "wan2.1-1.3b", layers=30, heads=12, head_dim=128, ffn=8960, text_len=512, params=1_418_996_800
    ),
    "wan2.1-14b": ModelShape(
        "wan2.1-14b", layers=40, heads=40, head_dim=128, ffn=13824, text_len=512, params=14_288_491_584
    ),
    "hunyuanvideo": ModelShape("hunyuanvideo", layers=60, heads=24, head_dim=128, ffn=12288, text_len=256),
    "tiny-wan": ModelShape(
        "tiny-wan",
        layers=4,
        heads=4,
        head_dim=48,
        ffn=768,
        text_len=32,
        params=2_712_816,
        text_dim=32,
        latent_channels=12,
        patch=(1, 2, 2),
        vae_stride=(4, 4, 4),
    ),
}
