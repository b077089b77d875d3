"""Frozen descriptions of a run: what to generate (items) and how (RunConfig, layout).

These objects are built by the CLI, validated at construction, pickled to each rank by
the launcher, and never mutated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from basics.errors import ConfigError
from planner.ditango import DiTangoOptions
from planner.hybrid import HybridConfig
from planner.layout import ParallelLayout, token_count
from planner.models import VideoSize
from runtime.models.adapters import Adapter, adapter_sets, check_sets
from runtime.models.schedulers import Sampler
from runtime.step_cache_options import StepCacheSpec

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]


def _nearest_multiples(value: int, multiple: int) -> str:
    lo = max(multiple, value // multiple * multiple)
    hi = lo + multiple if lo <= value else lo
    return f"{lo}" if lo == hi else f"{lo} or {hi}"


@dataclass(frozen=True)
class DecodeOptions:
    """How the writer's replica decodes: `tiling` (diffusers' tiled decode), `parallel` (the
    tiles over the replica's ranks; implies tiling), `tile_px` (the tile's side in pixels,
    None: the VAE's own, 256; stride 3/4 of it)."""

    tiling: bool = False
    parallel: bool = False
    tile_px: int | None = None

    def __post_init__(self) -> None:
        if self.tile_px is not None and self.tile_px < 8:
            raise ConfigError(f"--vae-tile must be >= 8 pixels, got {self.tile_px}")

    @property
    def tiled(self) -> bool:
        return self.tiling or self.parallel

    def on_one_rank(self) -> DecodeOptions:
        """The same decode on the writer alone: tiled as this one (a parallel decode is tiled), the
        tiles not spread. What the exact reference and a calibration are decoded with, so their
        frames differ from the run's by the run's approximation only, not by tile seams."""
        return replace(self, tiling=self.tiled, parallel=False)


# More denoising steps than the schedulers' training timesteps only repeat timesteps (diffusers'
# DDIM-style schedulers refuse them): no run needs more.
MAX_STEPS = 1000
MAX_FPS = 240  # an MP4 frame rate: video runs at 8-60
# Longer than a week is no timeout: and far longer ones overflow the process groups' timedelta.
MAX_TIMEOUT_S = 7 * 24 * 3600
# Shorter is no timeout either: a step's collectives wait that long for the slowest rank's work.
MIN_TIMEOUT_S = 1.0
STEP_TIMEOUT_S = 600.0  # --timeout: per-step collectives
SETUP_TIMEOUT_S = 1800.0  # --setup-timeout at least: bring-up, loading, the writer's decode


def check_timeouts(step_s: float, setup_s: float | None) -> None:
    """nan passes any comparison and inf overflows a timedelta: both would only fail inside the
    ranks; so would a timeout shorter than a collective can take (1e-9 s: gloo's own error)."""
    for flag, seconds in (("--timeout", step_s), ("--setup-timeout", setup_s)):
        if seconds is not None and not (math.isfinite(seconds) and MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S):
            raise ConfigError(
                f"{flag} must be a finite number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S} (7 days), "
                f"got {seconds:g}"
            )


def setup_timeout(step_s: float, given: float | None = None) -> float:
    """--setup-timeout: as given, else SETUP_TIMEOUT_S or the step timeout when that is longer."""
    return max(SETUP_TIMEOUT_S, step_s) if given is None else given


@dataclass(frozen=True)
class Item:
    """One video to generate. `source` says where it came from, for error messages."""

    id: str
    prompt: str
    negative_prompt: str
    seed: int
    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    index: int = 0
    source: str = "--prompt"
    guidance_2: float | None = None  # the low-noise expert's CFG scale (two-expert models)
    image: str | None = None  # image-to-video: absolute path of the conditioning image
    # HunyuanVideo: real CFG scale (diffusers' true_cfg_scale), `guidance` being the embedded
    # guidance; None for families whose `guidance` is the CFG scale.
    true_cfg: float | None = None
    loras: tuple[Adapter, ...] = ()  # LoRA adapters, resolved (runtime/models/adapters.py)
    # The solver and its flow shift (runtime/models/schedulers.py); None until resolved
    # against the model's own scheduler (`items.fit_to_model`), which every run does.
    scheduler: str | None = None
    flow_shift: float | None = None
    fps: int = 16  # the MP4's frame rate
    # The model's geometry (from its spec): the VAE's spatial and temporal strides, the
    # transformer's patch (Wan2.1: 8x in space, 4x in time, 2x2 patches).
    vae_stride: int = 8
    patch: tuple[int, int, int] = (1, 2, 2)
    temporal_stride: int = 4
    _tokens: int = field(init=False, repr=False, compare=False)  # `tokens()`, counted once

    def __post_init__(self) -> None:
        where = f"{self.source}: " if self.source else ""
        if not self.prompt.strip():
            raise ConfigError(f"{where}prompt is empty")
        t = self.temporal_stride
        if self.frames < 1 or (self.frames - 1) % t:
            k = max(0, round((self.frames - 1) / t))
            raise ConfigError(
                f"{where}frames must be {t}k+1 (the model's VAE compresses time {t}x), got {self.frames}; "
                f"try {t * k + 1}" + (f" or {t * k + t + 1}" if t * k + 1 < self.frames else "")
            )
        multiple = self.vae_stride * self.patch[1]
        for name, value in (("height", self.height), ("width", self.width)):
            if value < multiple or value % multiple:
                raise ConfigError(
                    f"{where}{name} must be a positive multiple of {multiple} (VAE {self.vae_stride}x "
                    f"times patch {self.patch[1]}x), got {value}; try {_nearest_multiples(value, multiple)}"
                )
        if not 1 <= self.steps <= MAX_STEPS:
            raise ConfigError(
                f"{where}steps must be in [1, {MAX_STEPS}] (the schedulers' {MAX_STEPS} training timesteps; "
                f"videos take 4-50), got {self.steps}"
            )
        if not (math.isfinite(self.guidance) and self.guidance >= 0):
            raise ConfigError(f"{where}guidance must be a finite number >= 0, got {self.guidance}")
        if self.true_cfg is not None and not (math.isfinite(self.true_cfg) and self.true_cfg >= 0):
            raise ConfigError(f"{where}true_cfg_scale must be a finite number >= 0, got {self.true_cfg}")
        if self.guidance_2 is not None and not (math.isfinite(self.guidance_2) and self.guidance_2 >= 0):
            raise ConfigError(f"{where}guidance_2 must be a finite number >= 0, got {self.guidance_2}")
        if not 1 <= self.fps <= MAX_FPS:
            raise ConfigError(f"{where}fps must be in [1, {MAX_FPS}], got {self.fps}")
        if self.seed < 0 or self.seed >= 2**63:
            raise ConfigError(f"{where}seed must be in [0, 2**63), got {self.seed}")
        object.__setattr__(self, "_tokens", token_count(self.latent_shape, self.patch))

    @property
    def cfg_scale(self) -> float:
        """The classifier-free guidance scale: two branches run when it is > 1."""
        return self.guidance if self.true_cfg is None else self.true_cfg

    @property
    def sampler(self) -> Sampler | None:
        return None if self.scheduler is None else Sampler(self.scheduler, self.flow_shift)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(frames, height, width) of the latent video."""
        t, s = self.temporal_stride, self.vae_stride
        return ((self.frames - 1) // t + 1, self.height // s, self.width // s)

    @property
    def size(self) -> VideoSize:
        return VideoSize(self.height, self.width, self.frames)

    def tokens(self) -> int:
        """Length of the transformer's token sequence for this item."""
        return self._tokens

    def to_json(self) -> dict:
        """What the item asks for, as the report, the sidecars and `check --json` state it."""
        return {
            "id": self.id,
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
            "frames": self.frames,
            "height": self.height,
            "width": self.width,
            "steps": self.steps,
            "guidance": self.guidance,
            "guidance_2": self.guidance_2,  # two-expert models: the low-noise expert's scale (None: guidance)
            "true_cfg_scale": self.true_cfg,  # HunyuanVideo: real CFG (guidance is the embedded one)
            "image": self.image,  # image-to-video: the conditioning image
            "loras": [a.to_json() for a in self.loras],  # source, scale, expert, file and its sha256
            "scheduler": self.scheduler,
            "flow_shift": self.flow_shift,
            "fps": self.fps,
            "tokens": self.tokens(),
        }


QUEUE_MODES = ("shared", "static")
MIN_LEASE_S = 2.0  # renewed every quarter of it: shorter is the file server's round trip


@dataclass(frozen=True)
class QueueSpec:
    """How a batch's items reach the replicas (--queue): "shared", each replica's leader takes
    the next one from the output folder's queue (runtime/batch_queue.py) under a lease of
    `lease_s` (--lease), or "static", today's round-robin split fixed before the first item.
    `batch`: the id of the batch the launcher began (None until it has); `launch`: this launch's
    key, which its workers' leases carry (the launcher breaks them when it sees it fail);
    `report`: the prefix of the workers' report files (a --join's own, so they never overwrite
    the batch owner's)."""

    mode: str = "shared"
    lease_s: float = 60.0
    batch: str | None = None
    launch: str = ""
    report: str = ""

    def __post_init__(self) -> None:
        if self.mode not in QUEUE_MODES:
            raise ConfigError(f"--queue must be one of {', '.join(QUEUE_MODES)}, got {self.mode!r}")
        if not (MIN_LEASE_S <= self.lease_s <= MAX_TIMEOUT_S):  # nan fails both
            raise ConfigError(f"--lease must be {MIN_LEASE_S:g} s to a week, got {self.lease_s:g}")

    @property
    def shared(self) -> bool:
        """Whether the items come from a queue: asked for, and its batch begun (a run built
        without a launcher that begins one, as in a test, splits its items round-robin)."""
        return self.mode == "shared" and self.batch is not None


@dataclass(frozen=True)
class RunConfig:
    """Everything one `ditango generate` needs; picklable so a launcher can ship it to ranks."""

    model: str  # registry name or directory, as the user gave it
    model_path: Path | None  # resolved directory; None for a built-in model
    items: tuple[Item, ...]
    out_dir: Path
    device: Device = "auto"
    dtype: DType | None = None  # None: float32 on CPU, bfloat16 on CUDA
    save_latents: bool = False
    no_audio: bool = False  # --no-audio: a model's audio track (LTX-2) is denoised but not decoded nor muxed
    overwrite: bool = False
    profile: bool = False  # --profile: a trace per rank and item, and a table of where the time went
    max_text_len: int = 512
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    attention_backend: str = "auto"  # --attention: auto | sdpa | flash | flash3 | reference (runtime/kernels.py)
    timeout_s: float = STEP_TIMEOUT_S  # per-step collectives: a stuck one fails after this long
    setup_timeout_s: float = SETUP_TIMEOUT_S  # bring-up, and the waits on the writer (loading, decoding, writing)
    ditango: DiTangoOptions | None = None  # --parallel ditango settings
    step_cache: StepCacheSpec | None = None  # --step-cache: a diffusers step cache (runtime/step_cache.py)
    reference: str | None = None  # "exact": also run the exact ring path and record quality
    hybrid: HybridConfig | None = None  # --hybrid (needs cfg degree 2)
    decode: DecodeOptions = DecodeOptions()  # --vae-tiling, --vae-parallel, --vae-tile
    shard_weights: bool = False  # --shard-weights: FSDP2 over the cp group (runtime/weights.py)
    compile: bool = False  # --compile: the repeated transformer block compiled (runtime/compile.py)
    quantize: str = "none"  # --quantize: "fp8", the blocks' linear layers in float8 (runtime/quantize.py)
    queue: QueueSpec = QueueSpec()  # --queue, --lease: how the items reach the replicas
    # Components moved to the CPU when their stage is over, chosen by the memory pre-flight
    # when the GPU is short (planner/memory.py): "text_encoder" after encoding, "transformer"
    # before the decode (back for the next item).
    offload: tuple[str, ...] = ()
    gpu_memory: int | None = None  # --gpu-memory: the pre-flight's bytes per GPU (None: the device's)
    host_memory: int | None = None  # host bytes per node the run needs (planner/host_memory.py): Slurm's --mem
    retries: int = 1  # a failed item is tried again this many times before it is given up
    # Data parallelism: `replicas` independent copies of `layout` (each its own process group)
    # take the items from the queue (or round-robin, --queue static). The allocation is
    # replicas x layout.world_size ranks on nodes of `alloc_gpus_per_node` ranks (None:
    # layout.gpus_per_node).
    replicas: int = 1
    alloc_gpus_per_node: int | None = None
    # The effective command-line options (report.json records them: a run file for a rerun)
    options: dict = field(default_factory=dict)
    layout_choice: dict | None = None  # --layout auto: the search's choice and why (ditango_cli/auto_layout.py)

    # Derived once from the fields above.
    gpus_per_node: int = field(init=False, repr=False, compare=False)  # ranks per node of the whole allocation
    world_size: int = field(init=False, repr=False, compare=False)  # ranks of the whole allocation (all replicas)
    nodes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus_per_node", self.alloc_gpus_per_node or self.layout.gpus_per_node)
        object.__setattr__(self, "world_size", self.replicas * self.layout.world_size)
        object.__setattr__(self, "nodes", self.world_size // self.gpus_per_node if self.gpus_per_node else 0)
        if not self.items:
            raise ConfigError("nothing to generate: no items")
        if self.retries < 0:
            raise ConfigError(f"--retries must be >= 0, got {self.retries}")
        check_timeouts(self.timeout_s, self.setup_timeout_s)
        check_sets(self.items, self.layout.strategy, self.shard_weights)
        if self.quantize != "none" and len(adapter_sets(self.items)) > 1:
            raise ConfigError(
                f"--quantize {self.quantize} quantizes the fused weights, and the items use "
                f"{len(adapter_sets(self.items))} LoRA sets, which stay unfused; run one set per run"
            )
        if self.setup_timeout_s < self.timeout_s:
            raise ConfigError(
                f"--setup-timeout ({self.setup_timeout_s:g} s) must be >= --timeout ({self.timeout_s:g} s): "
                "bring-up and writing outlast any one step"
            )
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.world_size % self.gpus_per_node or (self.gpus_per_node % self.layout.gpus_per_node):
            raise ConfigError(f"{self.replicas} replicas of {self.layout.world_size} rank(s) do not fill whole nodes")
        for item in self.items:
            if item.tokens() < self.layout.cp_degree:
                raise ConfigError(
                    f"{item.source}: {item.tokens()} tokens cannot be split over {self.layout.cp_degree} ranks; "
                    "use a larger size or fewer ranks"
                )
        if self.layout.cfg_degree == 2:
            for item in self.items:
                if item.cfg_scale <= 1.0:
                    what = "--true-cfg-scale" if item.true_cfg is not None else "guidance"
                    raise ConfigError(
                        f"{item.source}: --cfg-parallel needs {what} > 1 (two CFG branches), got {item.cfg_scale:g}"
                    )
        if self.hybrid is not None and self.layout.cfg_degree != 2:
            raise ConfigError("--hybrid needs --cfg-parallel")
        seen: dict[str, str] = {}
        for item in self.items:
            if item.id in seen:
                raise ConfigError(f"{item.source}: duplicate id {item.id!r} (first at {seen[item.id]})")
            seen[item.id] = item.source
