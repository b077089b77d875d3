"""Command-line options shared by `generate` and `check`, and the small argument objects
that turn them into validated config (layout, DiTango, Hybridiff)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from planner.ditango import PlannerConfig
from planner.hybrid import HybridConfig
from runtime.errors import ConfigError
from runtime.mesh import ParallelLayout
from runtime.models.registry import MODEL_ROOT_ENV
from runtime.strategies.ditango import DiTangoOptions


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DTypeChoice(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="Registry name (see `ditango models`) or a diffusers-format directory."),
]
ModelRootOpt = Annotated[
    Path | None,
    typer.Option("--model-root", help=f"Folder holding named checkpoints [env: {MODEL_ROOT_ENV}]."),
]
PromptOpt = Annotated[str | None, typer.Option("--prompt", "-p", help="One prompt.")]
PromptsOpt = Annotated[
    Path | None,
    typer.Option("--prompts", help="Batch file: .txt (a prompt per line) or .jsonl (an object per line)."),
]
NegativeOpt = Annotated[str | None, typer.Option("--negative-prompt", help="Negative prompt (default: empty).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the initial noise (per-item seeds override).")]
StepsOpt = Annotated[int | None, typer.Option("--steps", help="Denoising steps [default: the model's].")]
GuidanceOpt = Annotated[float | None, typer.Option("--guidance", help="CFG scale; <= 1 runs one branch.")]
HeightOpt = Annotated[int | None, typer.Option("--height", help="Pixels, a multiple of 16.")]
WidthOpt = Annotated[int | None, typer.Option("--width", help="Pixels, a multiple of 16.")]
FramesOpt = Annotated[int | None, typer.Option("--frames", help="Video frames, 4k+1.")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output folder.")]
DeviceOpt = Annotated[
    DeviceChoice,
    typer.Option(
        "--device",
        help="auto: CUDA when this machine (or the allocation) has GPUs; on a Slurm submission GPUs unless cpu.",
    ),
]
DTypeOpt = Annotated[
    DTypeChoice | None,
    typer.Option("--dtype", help="Transformer/text-encoder dtype [default: float32 on CPU, bfloat16 on CUDA]."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


class ParallelChoice(str, Enum):
    none = "none"
    ring = "ring"
    ulysses = "ulysses"
    usp = "usp"
    ditango = "ditango"


class ExecutorChoice(str, Enum):
    local = "local"
    slurm = "slurm"
    auto = "auto"


class BackendChoice(str, Enum):
    auto = "auto"
    flash = "flash"
    torch = "torch"
    reference = "reference"


NodesOpt = Annotated[
    int, typer.Option("--nodes", help="Nodes (locally: virtual nodes for topology and byte accounting).")
]
GpusOpt = Annotated[int, typer.Option("--gpus-per-node", "--gpus", help="Ranks per node.")]
ParallelOpt = Annotated[
    ParallelChoice | None,
    typer.Option(
        "--parallel", help="Context-parallel strategy [default: none on 1 rank, ring on more].", case_sensitive=False
    ),
]
UlyssesOpt = Annotated[
    int | None,
    typer.Option("--ulysses-degree", help="USP: Ulysses degree inside the cp axis [default: largest within a node]."),
]
ExecutorOpt = Annotated[
    ExecutorChoice,
    typer.Option(
        "--executor", help="local processes, a Slurm job, or auto (Slurm when sbatch exists and it is needed)."
    ),
]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Per-step collective timeout in seconds (a stuck rank fails after it).")
]
SetupTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--setup-timeout",
        help="Timeout in seconds of bring-up and of waits on rank 0 (loading, decoding, writing) [max(1800, --timeout)].",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run", help="Print what would be launched (sbatch script or srun command, ranks) and exit; runs nothing."
    ),
]
BackendOpt = Annotated[
    BackendChoice, typer.Option("--attention-backend", help="Attention kernel for parallel strategies.")
]


CacheRatioOpt = Annotated[
    float | None, typer.Option("--cache-ratio", help="DiTango: target fraction of remote attention reused [0.4].")
]
WarmupOpt = Annotated[int | None, typer.Option("--warmup", help="DiTango: exact steps at the start [5].")]
CooldownOpt = Annotated[int | None, typer.Option("--cooldown", help="DiTango: exact steps at the end [5].")]
GroupSizeOpt = Annotated[
    str | None, typer.Option("--group-size", help="DiTango: adjacent ranks per group, or 'node' [2].")
]
TauMaxOpt = Annotated[int | None, typer.Option("--tau-max", help="DiTango: recompute a cache this many steps old.")]
AnchorIntervalOpt = Annotated[
    int | None, typer.Option("--anchor-interval", help="DiTango: force an anchor step this often.")
]
AlphaOpt = Annotated[
    bool | None, typer.Option("--alpha/--no-alpha", help="DiTango: norm-ratio factor in the drift estimate [off].")
]
CacheDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--cache-dtype",
        help="DiTango: cached attention outputs in float32 or bfloat16 [bfloat16 on CUDA, float32 on CPU].",
    ),
]
ReferenceOpt = Annotated[
    str | None,
    typer.Option("--reference", help="DiTango: 'exact' also runs the exact ring path and records PSNR/SSIM."),
]
CfgParallelOpt = Annotated[
    bool, typer.Option("--cfg-parallel", help="Run the two CFG branches on two rank groups (world = 2 x cp).")
]
HybridOpt = Annotated[bool, typer.Option("--hybrid", help="Hybridiff: pipeline stage in the middle steps.")]
HybridKOpt = Annotated[int | None, typer.Option("--hybrid-k", help="Pipeline steps [5 at 50 steps, scaled].")]
HybridWindowOpt = Annotated[int | None, typer.Option("--hybrid-window", help="Slope window L [15 at 50 steps].")]
HybridSlopeOpt = Annotated[float | None, typer.Option("--hybrid-slope", help="Slope threshold [5e-4 at 50 steps].")]
HybridCapOpt = Annotated[int | None, typer.Option("--hybrid-tau-cap", help="Latest tau1 [40 at 50 steps].")]
HybridSplitOpt = Annotated[int | None, typer.Option("--hybrid-split", help="First block of segment 2 [half].")]
HybridTextOpt = Annotated[
    str, typer.Option("--hybrid-first-text", help="Text of segment 1: cond (clean variant) or uncond (authors').")
]
CacheLimitOpt = Annotated[
    str | None,
    typer.Option(
        "--cache-memory-limit",
        help="DiTango: cap per rank, e.g. 8GiB; adjacent groups are composed [on CUDA: the free memory, less headroom].",
    ),
]


def parse_bytes(text: str) -> int:
    """'8GiB', '500MB', '1048576' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper().rstrip()
    suffix = number.lstrip("0123456789.")
    value = number[: len(number) - len(suffix)]
    try:
        return int(float(value) * units[suffix.strip()])
    except (KeyError, ValueError):
        raise ConfigError(f"--cache-memory-limit {text!r}: expected a size like 8GiB, 500MB or 1048576") from None


PartitionOpt = Annotated[str | None, typer.Option("--partition", help="Slurm partition.")]
AccountOpt = Annotated[str | None, typer.Option("--account", help="Slurm account.")]
QosOpt = Annotated[str | None, typer.Option("--qos", help="Slurm QOS.")]
TimeOpt = Annotated[int, typer.Option("--time", help="Slurm time limit per job, minutes.")]
CpusOpt = Annotated[int | None, typer.Option("--cpus-per-task", help="Slurm CPUs per rank.")]
MemOpt = Annotated[str | None, typer.Option("--mem", help="Slurm memory per node, e.g. 200G.")]
ConstraintOpt = Annotated[str | None, typer.Option("--constraint", help="Slurm node constraint.")]
SlurmArgOpt = Annotated[
    list[str] | None, typer.Option("--slurm-arg", help="Extra sbatch option KEY=VALUE (repeatable).")
]
ArrayOpt = Annotated[int, typer.Option("--array", help="Split the items over N array tasks (locally: N rounds).")]
ArrayParOpt = Annotated[int | None, typer.Option("--array-parallelism", help="At most K array tasks at once.")]
ReplicasOpt = Annotated[
    int,
    typer.Option(
        "--replicas",
        min=1,
        help="Split the ranks into R independent model replicas that take the items round-robin (throughput).",
    ),
]
RetriesOpt = Annotated[
    int,
    typer.Option("--retries", min=0, help="Try a failed item again up to N times; then report it failed and go on."),
]
WaitOpt = Annotated[bool, typer.Option("--wait/--no-wait", help="Slurm: wait for the job (default) or return.")]


@dataclass(frozen=True)
class DiTangoArgs:
    cache_ratio: float | None = None
    warmup: int | None = None
    cooldown: int | None = None
    group_size: str | None = None
    tau_max: int | None = None
    anchor_interval: int | None = None
    alpha: bool | None = None
    cache_dtype: str | None = None
    cache_memory_limit: str | None = None
    reference: str | None = None

    def given(self) -> list[str]:
        return [f"--{k.replace('_', '-')}" for k, v in self.__dict__.items() if v is not None]

    def options(self) -> DiTangoOptions:
        def pick(value, default):
            return default if value is None else value

        planner = PlannerConfig(
            cache_ratio=pick(self.cache_ratio, 0.4), warmup=pick(self.warmup, 5), cooldown=pick(self.cooldown, 5),
            tau_max=self.tau_max, anchor_interval=self.anchor_interval, use_alpha=pick(self.alpha, False),
        )  # fmt: skip
        limit = None if self.cache_memory_limit is None else parse_bytes(self.cache_memory_limit)
        return DiTangoOptions(planner, self.cache_dtype, limit)


@dataclass(frozen=True)
class HybridArgs:
    cfg_parallel: bool = False
    hybrid: bool = False
    k: int | None = None
    window: int | None = None
    slope: float | None = None
    tau_cap: int | None = None
    split: int | None = None
    first_text: str = "cond"

    def config(self, layers: int) -> HybridConfig | None:
        tuned = {"--hybrid-k": self.k, "--hybrid-window": self.window, "--hybrid-slope": self.slope,
                 "--hybrid-tau-cap": self.tau_cap, "--hybrid-split": self.split}  # fmt: skip
        given = [k for k, v in tuned.items() if v is not None] + (
            ["--hybrid-first-text"] if self.first_text != "cond" else []
        )
        if not self.hybrid:
            if given:
                raise ConfigError(f"{', '.join(given)} only apply with --hybrid")
            return None
        if not self.cfg_parallel:
            raise ConfigError("--hybrid needs --cfg-parallel (the two CFG branches on two rank groups)")
        cfg = HybridConfig(self.k, self.window, self.slope, self.tau_cap, self.split, self.first_text)  # type: ignore[arg-type]
        cfg.split_for(layers)
        return cfg


@dataclass(frozen=True)
class ParallelArgs:
    nodes: int = 1
    gpus_per_node: int = 1
    parallel: ParallelChoice | None = None
    ulysses_degree: int | None = None
    timeout: float = 600.0
    setup_timeout: float | None = None
    attention_backend: BackendChoice = BackendChoice.auto
    ditango: DiTangoArgs = DiTangoArgs()
    hybrid: HybridArgs = HybridArgs()
    replicas: int = 1

    @classmethod
    def from_options(cls, o: dict) -> ParallelArgs:
        """From the keyword arguments of `generate` / `check` (they share these options)."""
        ditango = DiTangoArgs(
            o["cache_ratio"], o["warmup"], o["cooldown"], o["group_size"], o["tau_max"], o["anchor_interval"],
            o["alpha"], o["cache_dtype"], o["cache_memory_limit"], o["reference"],
        )  # fmt: skip
        hybrid = HybridArgs(
            o["cfg_parallel"], o["hybrid"], o["hybrid_k"], o["hybrid_window"], o["hybrid_slope"], o["hybrid_tau_cap"],
            o["hybrid_split"], o["hybrid_first_text"],
        )  # fmt: skip
        return cls(
            o["nodes"], o["gpus_per_node"], o["parallel"], o["ulysses_degree"], o["timeout"], o["setup_timeout"],
            o["attention_backend"], ditango, hybrid, o["replicas"],
        )  # fmt: skip

    @property
    def setup_timeout_s(self) -> float:
        return max(1800.0, self.timeout) if self.setup_timeout is None else self.setup_timeout

    def replica_shape(self) -> tuple[int, int]:
        """(nodes, ranks per node) of one replica: replicas split the nodes, or split each node."""
        r, n, g = self.replicas, self.nodes, self.gpus_per_node
        if n % r == 0:
            return n // r, g
        if r % n == 0 and g % (r // n) == 0:
            return 1, g // (r // n)
        raise ConfigError(
            f"--replicas {r} must divide the {n} nodes, or split each node's {g} ranks evenly "
            f"(e.g. --replicas {n} or {n * g})"
        )

    def layout(self, heads: int) -> ParallelLayout:
        """The layout of one replica (the whole allocation without --replicas)."""
        nodes, gpus_per_node = self.replica_shape()
        world = nodes * gpus_per_node
        cfg_degree = 2 if self.hybrid.cfg_parallel else 1
        if cfg_degree == 2 and world % 2:
            raise ConfigError(f"--cfg-parallel needs an even number of ranks, got {world}")
        cp = world // cfg_degree
        strategy = self.parallel.value if self.parallel else ("ring" if cp > 1 else "none")
        if self.hybrid.hybrid and strategy == "ditango":
            raise ConfigError("--hybrid does not combine with --parallel ditango; use ring, ulysses or usp")
        if strategy != "ditango" and self.ditango.given():
            raise ConfigError(f"{', '.join(self.ditango.given())} only apply to --parallel ditango")
        if self.ditango.reference not in (None, "exact"):
            raise ConfigError(f"--reference must be 'exact', got {self.ditango.reference!r}")
        group = self.ditango.group_size
        if group is not None and group != "node" and not group.isdigit():
            raise ConfigError(f"--group-size must be a number of ranks or 'node', got {group!r}")
        group_size = None if group is None else (gpus_per_node if group == "node" else int(group))
        layout = ParallelLayout(nodes, gpus_per_node, cfg_degree, strategy, self.ulysses_degree, group_size)
        layout = layout.with_default_ulysses(heads)
        layout.check_model(heads)
        return layout
