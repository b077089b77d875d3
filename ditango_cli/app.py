"""`ditango` commands: generate, check, models.

Parsing and validation only; the work is done by runtime/ (and, for multi-rank runs,
launched by slurm/). Predictable mistakes print one `error: ...` line on stderr and exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from ditango_cli.prompts import Overrides, build_items
from planner.ditango import PlannerConfig
from planner.hybrid import HybridConfig
from runtime.cache import compose_factor, unit_bytes
from runtime.config import RunConfig
from runtime.errors import ConfigError
from runtime.kernels import resolve_backend
from runtime.mesh import ParallelLayout
from runtime.models.loading import resolve_placement
from runtime.models.registry import MODEL_ROOT_ENV, REGISTRY, ResolvedModel, model_root, resolve_model
from runtime.strategies.ditango import DiTangoOptions
from runtime.strategies.sharding import chunk_sizes

EXIT_USAGE = 2
EXIT_FAILED_ITEMS = 1


def _is_click_exception(exc: BaseException) -> bool:
    # Typer >= 0.25 vendors click (typer._click), older releases use click itself:
    # recognise either by class name rather than importing a private module.
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


class OneLineErrors(TyperGroup):
    """Usage and configuration errors become one `error: ...` line and exit code 2."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            result = super().main(*args, **kwargs)
        except ConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(130)
        except Exception as exc:
            if not _is_click_exception(exc):
                raise
            message = exc.format_message()
            if message:  # empty for "no arguments: help shown"
                typer.echo(f"error: {message}", err=True)
            sys.exit(exc.exit_code)
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Batch video generation with Diffusion Transformers.",
)


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
DeviceOpt = Annotated[DeviceChoice, typer.Option("--device", help="auto picks CUDA when available.")]
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
    float, typer.Option("--timeout", help="Process-group timeout in seconds (a stuck rank fails after it).")
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
    str | None, typer.Option("--cache-dtype", help="DiTango: cached attention outputs in float32 or bfloat16.")
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
    typer.Option("--cache-memory-limit", help="DiTango: cap per rank, e.g. 8GiB; adjacent groups are composed."),
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
        return DiTangoOptions(planner, pick(self.cache_dtype, "float32"), limit)


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
    attention_backend: BackendChoice = BackendChoice.auto
    ditango: DiTangoArgs = DiTangoArgs()
    hybrid: HybridArgs = HybridArgs()

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
            o["nodes"], o["gpus_per_node"], o["parallel"], o["ulysses_degree"], o["timeout"], o["attention_backend"],
            ditango, hybrid,
        )  # fmt: skip

    def layout(self, heads: int) -> ParallelLayout:
        world = self.nodes * self.gpus_per_node
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
        group_size = None if group is None else (self.gpus_per_node if group == "node" else int(group))
        layout = ParallelLayout(self.nodes, self.gpus_per_node, cfg_degree, strategy, self.ulysses_degree, group_size)
        layout = layout.with_default_ulysses(heads)
        layout.check_model(heads)
        return layout


def check_writable(out: Path, create: bool) -> None:
    """Fail early (before loading anything) when outputs could not be written."""
    out = out.expanduser()
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError as exc:
            raise ConfigError(f"output dir {out} is not writable: {exc.strerror or exc}") from None
        return
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise ConfigError(f"output dir {out} is not writable: {probe} is not a writable directory")


def build_run_config(
    *,
    model: str,
    model_root_dir: Path | None,
    prompt: str | None,
    prompts: Path | None,
    overrides: Overrides,
    out: Path,
    device: DeviceChoice,
    dtype: DTypeChoice | None,
    save_latents: bool = False,
    overwrite: bool = False,
    parallel: ParallelArgs,
    create_out: bool,
) -> tuple[RunConfig, ResolvedModel]:
    placement = resolve_placement(device.value, None if dtype is None else dtype.value)  # before touching --out
    resolved = resolve_model(model, model_root_dir)
    items = build_items(prompt, prompts, overrides, resolved.spec.defaults)
    layout = parallel.layout(resolved.spec.heads)
    for item in items:
        if item.tokens() < layout.cp_degree:
            raise ConfigError(
                f"{item.source}: {item.tokens()} tokens cannot be split over {layout.cp_degree} ranks; "
                "use a larger size or fewer ranks"
            )
    if parallel.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {parallel.timeout:g}")
    ditango = parallel.ditango.options() if layout.strategy == "ditango" else None
    if ditango is not None and ditango.cache_limit_bytes is not None:  # fail now, not inside the ranks
        spec = resolved.spec
        dtype = ditango.torch_cache_dtype
        for item in items:
            tokens = max(chunk_sizes(item.tokens(), layout.cp_degree))
            per_unit = unit_bytes(1, tokens, spec.heads, spec.head_dim, dtype)
            branches = 1 if layout.cfg_degree == 2 or item.guidance <= 1 else 2
            compose_factor(layout.groups - 1, branches, spec.layers, per_unit, ditango.cache_limit_bytes)
    if placement.device.type == "cuda" and layout.world_size > torch.cuda.device_count():
        raise ConfigError(
            f"{layout.world_size} ranks need {layout.world_size} GPUs on this machine, found "
            f"{torch.cuda.device_count()} (NCCL needs one GPU per rank); use fewer ranks or --device cpu"
        )
    if layout.strategy != "none":
        resolve_backend(parallel.attention_backend.value, placement.device, placement.dtype)
    check_writable(out, create=create_out)
    cfg = RunConfig(
        model=model,
        model_path=resolved.path,
        items=items,
        out_dir=out.expanduser(),
        device=device.value,
        dtype=None if dtype is None else dtype.value,
        save_latents=save_latents,
        overwrite=overwrite,
        max_text_len=resolved.spec.defaults.max_text_len,
        fps=resolved.spec.defaults.fps,
        layout=layout,
        attention_backend=parallel.attention_backend.value,
        timeout_s=parallel.timeout,
        ditango=ditango,
        reference=parallel.ditango.reference,
        hybrid=parallel.hybrid.config(resolved.spec.layers),
    )
    return cfg, resolved


@app.command()
def generate(
    model: ModelOpt = "tiny-wan",
    model_root_dir: ModelRootOpt = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    negative_prompt: NegativeOpt = None,
    seed: SeedOpt = 0,
    steps: StepsOpt = None,
    guidance: GuidanceOpt = None,
    height: HeightOpt = None,
    width: WidthOpt = None,
    frames: FramesOpt = None,
    out: OutOpt = Path("out"),
    save_latents: Annotated[bool, typer.Option("--save-latents", help="Also write <id>.latents.safetensors.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Regenerate items whose outputs exist.")] = False,
    dtype: DTypeOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    nodes: NodesOpt = 1,
    gpus_per_node: GpusOpt = 1,
    parallel: ParallelOpt = None,
    ulysses_degree: UlyssesOpt = None,
    executor: ExecutorOpt = ExecutorChoice.auto,
    timeout: TimeoutOpt = 600.0,
    attention_backend: BackendOpt = BackendChoice.auto,
    cache_ratio: CacheRatioOpt = None,
    warmup: WarmupOpt = None,
    cooldown: CooldownOpt = None,
    group_size: GroupSizeOpt = None,
    tau_max: TauMaxOpt = None,
    anchor_interval: AnchorIntervalOpt = None,
    alpha: AlphaOpt = None,
    cache_dtype: CacheDtypeOpt = None,
    cache_memory_limit: CacheLimitOpt = None,
    reference: ReferenceOpt = None,
    cfg_parallel: CfgParallelOpt = False,
    hybrid: HybridOpt = False,
    hybrid_k: HybridKOpt = None,
    hybrid_window: HybridWindowOpt = None,
    hybrid_slope: HybridSlopeOpt = None,
    hybrid_tau_cap: HybridCapOpt = None,
    hybrid_split: HybridSplitOpt = None,
    hybrid_first_text: HybridTextOpt = "cond",
    partition: PartitionOpt = None,
    account: AccountOpt = None,
    qos: QosOpt = None,
    time_min: TimeOpt = 60,
    cpus_per_task: CpusOpt = None,
    mem: MemOpt = None,
    constraint: ConstraintOpt = None,
    slurm_arg: SlurmArgOpt = None,
    array: ArrayOpt = 1,
    array_parallelism: ArrayParOpt = None,
    wait_for_job: WaitOpt = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: JsonOpt = False,
) -> int:
    """Generate one MP4 per prompt, plus a sidecar JSON per item and report.json."""
    from ditango_cli.progress import RichObserver
    from runtime.run import SilentObserver  # heavy imports only when work is asked for
    from slurm.aggregate import aggregate
    from slurm.launch import launch
    from slurm.local import RankFailed
    from slurm.options import SlurmOptions, choose_executor
    from slurm.sharding import shard

    _quiet_libraries()
    overrides = Overrides(negative_prompt, seed, height, width, frames, steps, guidance)
    cfg, _ = build_run_config(
        model=model, model_root_dir=model_root_dir, prompt=prompt, prompts=prompts, overrides=overrides,
        out=out, device=device, dtype=dtype, save_latents=save_latents, overwrite=overwrite,
        parallel=ParallelArgs.from_options(locals()),
        create_out=True,
    )  # fmt: skip
    err = Console(stderr=True, soft_wrap=True)
    if cfg.hybrid is not None and cfg.hybrid.scaled() and not quiet:
        for n in sorted({i.steps for i in cfg.items} - {50}):
            r = cfg.hybrid.resolved(n)
            err.print(
                f"note: --hybrid defaults are the paper's 50-step values scaled to {n} steps: k {r.k}, "
                f"window {r.window}, slope {r.slope:g}, tau cap {r.tau_cap}"
                + (" (k 1: the pipeline window is only its fill step)" if r.k == 1 else ""),
                highlight=False,
            )
    slurm_opts = SlurmOptions(
        partition=partition, account=account, qos=qos, time_min=time_min, cpus_per_task=cpus_per_task, mem=mem,
        constraint=constraint, extra=SlurmOptions.parse_extra(slurm_arg or []), array=array,
        array_parallelism=array_parallelism,
    )  # fmt: skip
    if array > len(cfg.items):
        raise ConfigError(f"--array {array} is more than the {len(cfg.items)} items")
    where = choose_executor(executor.value, cfg.layout.nodes, slurm_opts)
    if where == "srun":
        raise ConfigError("starting ranks inside an existing allocation (srun) is not supported yet; "
                          "use --executor local, or submit from a login node")  # fmt: skip
    if not quiet and executor == ExecutorChoice.auto and where == "local" and cfg.layout.nodes > 1:
        err.print(f"executor: local ({cfg.layout.nodes} virtual nodes; no sbatch on PATH)", highlight=False)
    if where == "sbatch":
        return _run_on_slurm(cfg, slurm_opts, wait_for_job, quiet, as_json, err)
    observer = contextlib.nullcontext(SilentObserver()) if quiet else RichObserver(err)
    try:
        with observer as obs:
            if array == 1:
                report = launch(cfg, obs)
            else:  # the Slurm array's sharding, one shard after the other
                for task in range(array):
                    shard_cfg = replace(cfg, items=tuple(shard(cfg.items, task, array)))
                    launch(shard_cfg, obs, report_name=f"report.task-{task}.json")
                report = aggregate(cfg.out_dir)
    except RankFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        return EXIT_FAILED_ITEMS
    return _report_summary(report, cfg.out_dir / "report.json", quiet, as_json, err)


@app.command()
def check(
    model: ModelOpt = "tiny-wan",
    model_root_dir: ModelRootOpt = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    negative_prompt: NegativeOpt = None,
    seed: SeedOpt = 0,
    steps: StepsOpt = None,
    guidance: GuidanceOpt = None,
    height: HeightOpt = None,
    width: WidthOpt = None,
    frames: FramesOpt = None,
    out: OutOpt = Path("out"),
    dtype: DTypeOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    nodes: NodesOpt = 1,
    gpus_per_node: GpusOpt = 1,
    parallel: ParallelOpt = None,
    ulysses_degree: UlyssesOpt = None,
    executor: ExecutorOpt = ExecutorChoice.auto,
    timeout: TimeoutOpt = 600.0,
    attention_backend: BackendOpt = BackendChoice.auto,
    cache_ratio: CacheRatioOpt = None,
    warmup: WarmupOpt = None,
    cooldown: CooldownOpt = None,
    group_size: GroupSizeOpt = None,
    tau_max: TauMaxOpt = None,
    anchor_interval: AnchorIntervalOpt = None,
    alpha: AlphaOpt = None,
    cache_dtype: CacheDtypeOpt = None,
    cache_memory_limit: CacheLimitOpt = None,
    reference: ReferenceOpt = None,
    cfg_parallel: CfgParallelOpt = False,
    hybrid: HybridOpt = False,
    hybrid_k: HybridKOpt = None,
    hybrid_window: HybridWindowOpt = None,
    hybrid_slope: HybridSlopeOpt = None,
    hybrid_tau_cap: HybridCapOpt = None,
    hybrid_split: HybridSplitOpt = None,
    hybrid_first_text: HybridTextOpt = "cond",
    as_json: JsonOpt = False,
) -> int:
    """Validate a would-be `generate` (model directory, prompts, sizes, output) without loading weights."""
    overrides = Overrides(negative_prompt, seed, height, width, frames, steps, guidance)
    cfg, resolved = build_run_config(
        model=model, model_root_dir=model_root_dir, prompt=prompt, prompts=prompts, overrides=overrides,
        out=out, device=device, dtype=dtype, create_out=False,
        parallel=ParallelArgs.from_options(locals()),
    )  # fmt: skip
    from runtime.run import plan_resume

    placement = resolve_placement(cfg.device, cfg.dtype)
    skipped = plan_resume(cfg) if cfg.out_dir.is_dir() else {}
    spec = resolved.spec
    summary = {
        "model": cfg.model,
        "model_path": None if resolved.path is None else str(resolved.path),
        "transformer": {"params": spec.params, "heads": spec.heads, "layers": spec.layers, "head_dim": spec.head_dim},
        "device": str(placement.device),
        "dtype": placement.dtype_name,
        "out_dir": str(cfg.out_dir),
        "layout": cfg.layout.to_json(),
        "attention_backend": "diffusers"
        if cfg.layout.strategy == "none"
        else resolve_backend(cfg.attention_backend, placement.device, placement.dtype),
        "skipped": sorted(skipped),
        "items": [
            {
                "id": i.id, "prompt": i.prompt, "negative_prompt": i.negative_prompt, "seed": i.seed,
                "height": i.height, "width": i.width, "frames": i.frames, "steps": i.steps,
                "guidance": i.guidance, "tokens": i.tokens(),
            }
            for i in cfg.items
        ],
    }  # fmt: skip
    if as_json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
        return 0
    console = Console()
    console.print(
        f"model {summary['model']} ({summary['model_path'] or 'built-in'}), {spec.layers} layers, "
        f"{spec.heads} heads; device {summary['device']}, dtype {summary['dtype']}; out {summary['out_dir']}; "
        f"{cfg.layout.world_size} rank(s), strategy {cfg.layout.strategy} "
        f"(ulysses {cfg.layout.ulysses} x ring {cfg.layout.ring}, attention {summary['attention_backend']})",
        highlight=False,
    )
    table = Table("id", "prompt", "seed", "size", "frames", "steps", "guidance", "tokens")
    for i in summary["items"]:
        short = i["prompt"] if len(i["prompt"]) <= 48 else i["prompt"][:45] + "..."
        table.add_row(
            i["id"], short, str(i["seed"]), f"{i['width']}x{i['height']}", str(i["frames"]),
            str(i["steps"]), f"{i['guidance']:g}", str(i["tokens"]),
        )  # fmt: skip
    console.print(table)
    todo = len(cfg.items) - len(skipped)
    console.print(f"ok: {todo} item(s) would be generated, {len(skipped)} skipped (outputs exist)", highlight=False)
    return 0


@app.command()
def models(
    model_root_dir: ModelRootOpt = None,
    as_json: JsonOpt = False,
) -> int:
    """List registry names with size, heads, layers and where each resolves."""
    root = model_root(model_root_dir)
    rows = []
    for spec in REGISTRY.values():
        if spec.builtin:
            where = "built-in"
        elif root is None:
            where = f"not configured (set --model-root or {MODEL_ROOT_ENV})"
        else:
            path = root / spec.dir_name
            where = str(path) if path.is_dir() else f"missing: {path}"
        rows.append(
            {"name": spec.name, "params": spec.params, "heads": spec.heads, "layers": spec.layers,
             "head_dim": spec.head_dim, "resolves_to": where, "description": spec.description}
        )  # fmt: skip
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table("name", "params", "heads", "layers", "resolves to")
    for r in rows:
        table.add_row(r["name"], _human(r["params"]), str(r["heads"]), str(r["layers"]), r["resolves_to"])
    Console().print(table)
    return 0


@app.command()
def simulate(
    model: Annotated[str, typer.Option("--model", "-m", help="wan2.1-1.3b, wan2.1-14b, hunyuanvideo, tiny-wan.")] = (
        "wan2.1-14b"
    ),
    nodes: NodesOpt = 4,
    gpus_per_node: GpusOpt = 8,
    hardware: Annotated[str, typer.Option("--hardware", help="h20, h100, h200, a100, l40s.")] = "h20",
    hardware_file: Annotated[
        Path | None, typer.Option("--hardware-file", help="JSON profile overriding --hardware.")
    ] = None,
    parallel: Annotated[
        str, typer.Option("--parallel", help="Comma-separated strategies.")
    ] = "ring,ulysses,usp,ditango",
    plan: Annotated[
        Path | None, typer.Option("--plan", help="report.json of a DiTango run: its computed fraction.")
    ] = None,
    cache_ratio: Annotated[float, typer.Option("--cache-ratio", help="DiTango without --plan.")] = 0.4,
    group_size: Annotated[str, typer.Option("--group-size", help="DiTango group: ranks or 'node'.")] = "node",
    height: Annotated[int, typer.Option("--height")] = 720,
    width: Annotated[int, typer.Option("--width")] = 1280,
    frames: Annotated[int, typer.Option("--frames")] = 81,
    steps: Annotated[int, typer.Option("--steps")] = 50,
    as_json: JsonOpt = False,
) -> int:
    """Price strategies on a hardware profile: per-step attention, step and end-to-end time, bytes."""
    from planner.cost_model import (
        MODELS,
        estimate,
        load_hardware,
        map_plan_offsets,
        plan_fraction_from_report,
        report_dict,
        synthetic_plan_fraction,
    )  # fmt: skip

    if model not in MODELS:
        raise ConfigError(f"unknown model {model!r} for simulate: use one of {', '.join(MODELS)}")
    shape = MODELS[model]
    hw = load_hardware(str(hardware_file) if hardware_file else hardware)
    strategies = [s.strip() for s in parallel.split(",") if s.strip()]
    for s in strategies:
        if s not in ("ring", "ulysses", "usp", "ditango"):
            raise ConfigError(f"--parallel {s!r}: simulate knows ring, ulysses, usp, ditango")
    plan_log = None
    if plan is not None:
        try:
            report = json.loads(plan.read_text(encoding="utf-8"))
            fraction = plan_fraction_from_report(report)
            plan_files = [(i.get("attention") or {}).get("plan_file") for i in report.get("items", [])]
            plan_file = next((plan.parent / f for f in plan_files if f), None)
            if plan_file is not None and plan_file.is_file():
                plan_log = json.loads(plan_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--plan {plan}: cannot read ({exc})") from None
    else:
        fraction = synthetic_plan_fraction(cache_ratio, steps)
    rows, notes = [], []
    for n in range(1, nodes + 1):
        found = []
        for s in strategies:
            try:
                group = None
                if s == "ditango":
                    group = gpus_per_node if group_size == "node" else int(group_size)
                layout = ParallelLayout(n, gpus_per_node, 1, s, None, group).with_default_ulysses(shape.heads)
                layout.check_model(shape.heads)
            except (ConfigError, ValueError) as exc:
                notes.append(f"{s} on {n} node(s): {exc}")
                continue
            f = fraction
            if s == "ditango" and plan_log is not None:
                f = map_plan_offsets(plan_log, layout.groups)  # per ring offset, by relative distance
            est = estimate(hw, layout, shape, height, width, frames, steps,
                           compute_fraction=f if s == "ditango" else 1.0)  # fmt: skip
            found.append(est)
        exact = [e.e2e_s for e in found if e.strategy != "ditango"]
        best = min(exact) if exact else None
        for e in found:
            rows.append(
                {"strategy": e.strategy, "nodes": e.nodes, "gpus_per_node": e.gpus_per_node,
                 "attention_s": round(e.attention_s, 6), "step_s": round(e.step_s, 6), "e2e_s": round(e.e2e_s, 4),
                 "inter_node_bytes": e.inter_node_bytes, "intra_node_bytes": e.intra_node_bytes,
                 "speedup_vs_best_exact": None if best is None else round(best / e.e2e_s, 4)}
            )  # fmt: skip
    assumptions = {**report_dict(hw), "model": model, "tokens": shape.tokens(height, width, frames),
                   "steps": steps, "ditango_computed_fraction": round(fraction, 4),
                   "ditango_plan": (f"{plan} (per ring offset from its plan file)" if plan_log is not None
                                    else str(plan)) if plan else f"synthetic, cache ratio {cache_ratio:g}",
                   "skipped": notes}  # fmt: skip
    if as_json:
        print(json.dumps({"schema": 1, "assumptions": assumptions, "rows": rows}, indent=2))
        return 0
    console = Console()
    console.print(
        f"{model}, {width}x{height}x{frames} ({assumptions['tokens']} tokens), {steps} steps, "
        f"{hw.name} x {gpus_per_node} per node; DiTango computes {fraction:.0%} of remote attention "
        f"({assumptions['ditango_plan']}). Bytes are exact counts; times are modelled (see --json assumptions).",
        highlight=False,
    )
    table = Table("strategy", "nodes", "attention/step (s)", "step (s)", "e2e (s)", "inter-node GB", "intra-node GB",
                  "vs best exact")  # fmt: skip
    for r in rows:
        speed = "-" if r["speedup_vs_best_exact"] is None else f"{r['speedup_vs_best_exact']:.2f}x"
        table.add_row(r["strategy"], str(r["nodes"]), f"{r['attention_s']:.3f}", f"{r['step_s']:.3f}",
                      f"{r['e2e_s']:.1f}", f"{r['inter_node_bytes'] / 1e9:.1f}", f"{r['intra_node_bytes'] / 1e9:.1f}",
                      speed)  # fmt: skip
    console.print(table)
    for note in notes:
        console.print(f"skipped: {note}", highlight=False)
    return 0


def _report_summary(report: dict, report_path: Path, quiet: bool, as_json: bool, err: Console) -> int:
    counts = report["counts"]
    if as_json:
        print(report_path)
    elif not quiet:
        err.print(
            f"{counts['done']} generated, {counts['skipped']} skipped, {counts['failed']} failed; report: {report_path}",
            highlight=False,
        )
    if counts["failed"]:
        failed = [r["id"] for r in report["items"] if r["status"] == "failed"]
        typer.echo(f"error: {len(failed)} item(s) failed: {', '.join(failed)} (see {report_path})", err=True)
        return EXIT_FAILED_ITEMS
    return 0


def _run_on_slurm(cfg, opts, wait_for_job: bool, quiet: bool, as_json: bool, err: Console) -> int:
    from slurm.aggregate import aggregate
    from slurm.submit import submit, wait

    jobs = submit(cfg, opts)
    ids = ", ".join(j.job_id for j in jobs)
    if not wait_for_job:
        typer.echo(f"submitted job(s) {ids}; follow with: ditango status {cfg.out_dir}")
        return 0
    if not quiet:
        err.print(f"submitted job(s) {ids}; waiting (Ctrl-C stops waiting, not the job)", highlight=False)
    last = None

    def show(states):
        nonlocal last
        if not quiet and states != last:
            err.print(f"  {', '.join(states)}", highlight=False)
            last = states

    errors = wait(jobs, show)
    report = aggregate(cfg.out_dir)
    failed = [(j.job_id, e) for j, e in zip(jobs, errors, strict=True) if e]
    if failed:
        for job_id, error in failed:
            typer.echo(f"error: job {job_id} failed: {error}", err=True)
        return EXIT_FAILED_ITEMS
    return _report_summary(report, cfg.out_dir / "report.json", quiet, as_json, err)


@app.command()
def status(out: Annotated[Path, typer.Argument(help="The --out folder of a submitted batch.")]) -> int:
    """State of the Slurm jobs submitted for OUT and of its items."""
    from slurm.submit import failed_state, job_states

    rows = job_states(out)
    table = Table("job", "state", "submitted", "error")
    for r in rows:
        table.add_row(r["job_id"], r["state"], r["submitted_at"], escape(r["error"] or ""))
    Console().print(table)
    sidecars = [p for p in out.glob("*.json") if p.name not in ("jobs.json",) and not p.name.startswith("report")]
    done = sum(1 for p in sidecars if '"status": "done"' in p.read_text(encoding="utf-8"))
    Console().print(f"{done} item(s) done in {out}", highlight=False)
    return 1 if any(failed_state(r["state"]) for r in rows) else 0


@app.command()
def cancel(out: Annotated[Path, typer.Argument(help="The --out folder of a submitted batch.")]) -> int:
    """Cancel every Slurm job submitted for OUT (finished items stay; a rerun resumes)."""
    from slurm.submit import cancel as cancel_jobs

    ids = cancel_jobs(out)
    typer.echo(f"cancelled {', '.join(ids) if ids else 'nothing'}")
    return 0


@app.command()
def report(
    out: Annotated[Path, typer.Argument(help="Output folder of a batch.")],
    as_json: JsonOpt = False,
) -> int:
    """Aggregate a batch's task reports and sidecars into OUT/report.json and print a table."""
    from slurm.aggregate import aggregate

    if not out.is_dir():
        raise ConfigError(f"{out} is not a directory")
    merged = aggregate(out)
    if as_json:
        print(out / "report.json")
        return 0
    table = Table("id", "status", "total (s)", "inter-node MB", "intra-node MB")
    for item in merged["items"]:
        timing, comm = item.get("timing") or {}, item.get("comm") or {}
        table.add_row(
            item["id"], item["status"], f"{timing.get('total_s', 0):.2f}",
            f"{comm.get('inter_node_bytes', 0) / 1e6:.2f}", f"{comm.get('intra_node_bytes', 0) / 1e6:.2f}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    c = merged["counts"]
    console.print(f"{c['done']} done, {c['skipped']} skipped, {c['failed']} failed -> {out / 'report.json'}")
    return 0


def _quiet_libraries() -> None:
    """Our progress bar is the only one: hide diffusers'/transformers' loading bars."""
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
