"""The shape of a model as the planner sees it (cost model, memory model, layout checks).

Shapes are made by each model family's adapter from the components' configs
(runtime/models/wan/shapes.py `shape_of`, `vae_shape_of`) and kept with the registry entries
(runtime/models/registry.py): the one source for the registry, `check`, the cost model and
the memory model (planner/memory.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from basics.errors import ConfigError
from planner.layout import token_count


class VideoSize(NamedTuple):
    """A video as an item asks for it: pixels high and wide, and frames."""

    height: int
    width: int
    frames: int


@dataclass(frozen=True)
class VaeShape:
    """What the memory model needs of a video VAE's decoder (weights are float32).

    The decoder works at `len(widths)` resolutions, the latent's first, each twice the one
    before (the last is the output, `patch` x `patch` pixel blocks as channels for Wan2.2's VAE).
    Per resolution: `widths` the widest channel count there, `cached` the summed input
    channels of its causal convolutions (Wan keeps the last 2 frames of each input between
    frame chunks; 0 for HunyuanVideo, which pads instead), `time_up` whether the frames grow
    on leaving it. `chunk_frames` latent frames go through the decoder per call (Wan: 1, its
    caches carry the rest; HunyuanVideo: diffusers' frame chunks of 4 + 1, every `chunk_stride`).
    `masked_attention`: the mid block's attention takes a dense causal mask over all the
    chunk's latent tokens (HunyuanVideo).
    """

    params: int = 0
    z_dim: int = 16
    spatial: int = 8  # output pixels per latent pixel, per side
    temporal: int = 4
    patch: int = 1
    widths: tuple[int, ...] = (384, 384, 192, 96)
    cached: tuple[int, ...] = (0, 0, 0, 0)
    time_up: tuple[bool, ...] = (True, True, False, False)
    chunk_frames: int = 1
    chunk_stride: int = 1
    masked_attention: bool = False
    # True (Wan): latent frames go one at a time through causal caches, the first decoding to
    # one frame and every other to `temporal`; a call's frames double at a temporal upsampler.
    # False (HunyuanVideo): overlapping chunks, each call keeping its first frame (f -> 2f - 1).
    causal_frames: bool = True
    # Live tensors at the widest resolution per (channels x frames x area), calibrated per
    # decoder on CPU against measured decodes (benchmarks/memory.py states the error).
    activation_factor: float = 8.0

    def __post_init__(self) -> None:
        if self.activation_factor <= 0:
            raise ConfigError(f"VAE shape: activation_factor must be > 0, got {self.activation_factor}")
        n = len(self.widths)
        if n < 1 or len(self.cached) != n or len(self.time_up) != n:
            raise ConfigError(
                f"VAE shape: widths, cached and time_up need one entry per decoder resolution, got "
                f"{len(self.widths)}, {len(self.cached)} and {len(self.time_up)}"
            )
        if self.spatial != self.patch * 2 ** (n - 1):
            raise ConfigError(
                f"VAE shape: {n} decoder resolutions and patch {self.patch} make a spatial ratio of "
                f"{self.patch * 2 ** (n - 1)}, not {self.spatial}"
            )
        if min(self.chunk_frames, self.chunk_stride, self.temporal) < 1:
            raise ConfigError("VAE shape: chunk_frames, chunk_stride and temporal must be >= 1")


# The largest size of each kind a model may have: far above every DiT released, far below what
# would make a meta-device build or the memory model run for ever.
SIZE_LIMITS = {"layers": 10_000, "heads": 4096, "head_dim": 8192, "ffn": 2**20, "text_len": 2**20, "text_dim": 2**20,
               "latent_channels": 4096}  # fmt: skip
PATCH_LIMIT = 64  # of the patch and the VAE's strides, per axis


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
    # The family's pipeline guides with forwards of its own beyond CFG's two (LTX-2): no
    # CFG-parallel, Hybridiff, reuse or step cache (ditango_cli/run_config.py refuses them).
    own_guidance: bool = False
    # Forwards a guided step runs in turn on one rank group: CFG's two; LTX-2.0's pipeline three
    # (CFG's and the modality-isolated one), four where its spatio-temporal guidance perturbs.
    guided_forwards: int = 2
    # For the memory model (planner/memory.py); 0 / None: not known, not counted.
    block_params: int = 0  # the largest transformer block (what FSDP gathers at once)
    root_params: int = 0  # one transformer's parameters outside its blocks (embeddings, head)
    # What --shard-weights all-gathers in every forward of one transformer: the parameters of
    # its FSDP units but the root (blocks, and the root's own module lists), less those kept
    # whole in float32 (runtime/weights.py). The root's (`fsdp_root_gathered_params`) are gathered
    # at its first forward and stay gathered (FSDP2 does not reshard a root after its forward).
    fsdp_gathered_params: int = 0
    fsdp_root_gathered_params: int = 0
    text_encoder_params: int = 0  # all text encoders together, in the transformer's dtype
    text_encoder_block_params: int = 0  # its largest block (what FSDP gathers at once)
    text_encoder_root_params: int = 0  # its parameters outside the blocks (token embeddings, final norm)
    text_encoder_whole_params: int = 0  # text encoders --shard-weights leaves whole (HunyuanVideo's CLIP)
    image_encoder_params: int = 0  # CLIP image encoder (float32)
    image_tokens: int = 0  # its tokens in every cross-attention (Wan2.1 I2V: 257)
    per_token_time: bool = False  # per-token timestep embeddings [B, S, 6C] (Wan2.2 TI2V)
    vae: VaeShape | None = None

    def __post_init__(self) -> None:
        # A model folder's config is the user's: a zero or negative size would surface later as
        # a division by zero or an empty tensor deep inside a rank, and a size no model has
        # (10^30 layers) as a build that never ends.
        sizes = {key: getattr(self, key) for key in SIZE_LIMITS}
        sizes |= {f"patch[{i}]": p for i, p in enumerate(self.patch)}
        sizes |= {f"vae_stride[{i}]": s for i, s in enumerate(self.vae_stride)}
        for key, value in sizes.items():
            most = SIZE_LIMITS.get(key, PATCH_LIMIT)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ConfigError(
                    f"{self.name}: the transformer config's {key} must be a positive integer of at most {most}, "
                    f"got {value!r}"
                )

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def out_channels(self) -> int:
        return self.latent_channels * math.prod(self.patch)

    def latent_shape(self, size: VideoSize) -> tuple[int, int, int]:
        t, s, _ = self.vae_stride
        return ((size.frames - 1) // t + 1, size.height // s, size.width // s)

    def tokens(self, size: VideoSize) -> int:
        return token_count(self.latent_shape(size), self.patch)
