"""Command-line options, declared once as typed groups that the commands share.

Each group is a dataclass whose fields are the options (field name = option name with
underscores: `negative_prompt` for `--negative-prompt`), their defaults and help (the run
defaults of DiTango come from planner/ditango.py, the timeouts from runtime/config.py);
ditango_cli/command.py turns groups into a command and reads run files.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated

import typer

from basics.user_files import Unreadable, user_path
from ditango_cli.choices import (
    CACHE_DTYPES,
    REFERENCES,
    BackendChoice,
    DeviceChoice,
    DTypeChoice,
    ExecutorChoice,
    LayoutChoice,
    ObjectiveChoice,
    ParallelChoice,
    QuantizeChoice,
    SolverChoice,
    _o,
    canonical_model,
    flag_choice,
    planner_choice,
)
from ditango_cli.generate_options import GenerateArgs
from planner.ditango import OWN_GROUP_MODES, PLANNERS, REUSE_MODES, RUN_DEFAULTS
from planner.hybrid import FIRST_SEGMENT_TEXTS
from planner.strategy import DEFAULT_CP, STRATEGIES
from runtime.config import SETUP_TIMEOUT_S, STEP_TIMEOUT_S, setup_timeout
from runtime.models.hub import MODEL_ROOT_ENV


@dataclass
class ModelArgs:
    model: Annotated[
        str,
        _o(
            "--model",
            "-m",
            help="Registry name (see `ditango models`), Hugging Face repo id ORG/NAME[@REVISION], or a diffusers "
            "directory.",
            callback=canonical_model,
        ),
    ] = "tiny-wan"
    model_root: Annotated[
        Path | None, _o("--model-root", **PATH, help=f"Folder of named checkpoints [env: {MODEL_ROOT_ENV}].")
    ] = None
    revision: Annotated[
        str | None,
        _o("--revision", help="Hugging Face cache: a branch, tag or commit of the repo [refs/main]."),
    ] = None
    download: Annotated[
        bool,
        _o("--download", help="Fetch a model found neither under --model-root nor in the HF cache, on this host."),
    ] = False
    dtype: Annotated[
        DTypeChoice | None,
        _o("--dtype", help="Transformer/text-encoder dtype [default: float32 on CPU, bfloat16 on CUDA]."),
    ] = None
    device: Annotated[
        DeviceChoice,
        _o("--device", help="auto: CUDA when this machine (or the allocation) has GPUs; a Slurm submission: GPUs."),
    ] = DeviceChoice.auto
    compile: Annotated[
        bool | None,
        _o(
            "--compile/--no-compile",
            help="Compile the repeated transformer block (torch.compile) [on CUDA, off on CPU].",
        ),
    ] = None
    quantize: Annotated[
        QuantizeChoice,
        _o("--quantize", help="fp8: the transformer blocks' linear layers in float8 (e4m3), scaled per channel."),
    ] = QuantizeChoice.none


@dataclass
class ItemArgs:
    prompt: Annotated[str | None, _o("--prompt", "-p", help="One prompt.")] = None
    prompts: Annotated[Path | None, _o("--prompts", **PATH, help="Batch file: .txt or .jsonl, a prompt a line.")] = None
    negative_prompt: Annotated[
        str | None, _o("--negative-prompt", help='Negative prompt [the model\'s; "" for none].')
    ] = None
    seed: Annotated[int, _o("--seed", help="Seed of the initial noise (per-item seeds override).")] = 0
    steps: Annotated[int | None, _o("--steps", help="Denoising steps [the model's].")] = None
    guidance: Annotated[float | None, _o("--guidance", help="CFG scale; <= 1 runs one branch.")] = None
    guidance_2: Annotated[
        float | None, _o("--guidance-2", help="Two-expert models: the low-noise expert's CFG scale [the model's].")
    ] = None
    true_cfg_scale: Annotated[
        float | None, _o("--true-cfg-scale", help="HunyuanVideo: real CFG when > 1 (--guidance: embedded).")
    ] = None
    image: Annotated[
        Path | None, _o("--image", **PATH, help="Image-to-video: the first frame (JSONL lines may give their own).")
    ] = None
    lora: Annotated[
        list[str] | None,
        _o("--lora", help="LoRA SOURCE[:SCALE] (a .safetensors file, its folder or a repo id; scale 1), repeatable."),
    ] = None
    lora_2: Annotated[
        list[str] | None, _o("--lora-2", help="Two-expert models: a LoRA of the second (low-noise) expert.")
    ] = None
    scheduler: Annotated[
        SolverChoice | None,
        _o("--scheduler", help="Solver: unipc, euler or dpm++ [the model's].", case_sensitive=False),
    ] = None
    flow_shift: Annotated[
        float | None, _o("--flow-shift", help="Shift of the sigma schedule [the model's; Wan: 3 at 480p, 5 at 720p].")
    ] = None
    fps: Annotated[int | None, _o("--fps", help="Frame rate of the MP4 [the model's].")] = None
    height: Annotated[int | None, _o("--height", help="Pixels, a multiple of the model's geometry.")] = None
    width: Annotated[int | None, _o("--width", help="Pixels, a multiple of the model's geometry.")] = None
    frames: Annotated[
        int | None, _o("--frames", help="Video frames, tk+1 for the VAE's time stride t (4; LTX-2: 8).")
    ] = None


def given_path(value: str | Path) -> Path:
    """A path option's value with `~` and `~user` expanded as a shell would (a run file's paths,
    and quoted ones, come unexpanded); a user with no home here is refused in one line."""
    try:
        return user_path(value, "")
    except Unreadable as exc:
        raise typer.BadParameter(f"{value}: {exc.reason}") from None


# typer.Option arguments of an option that names a file or folder.
PATH = {"parser": given_path, "metavar": "PATH"}


def _output_folder(value: str | Path) -> Path:
    """--out as a Path; an empty value (a typo, an unset shell variable) would quietly be the
    current folder, so it is refused."""
    if not isinstance(value, Path) and not value:
        raise typer.BadParameter("is empty; give a folder (--out . for the current one)")
    return given_path(value)


@dataclass
class OutputArgs:
    out: Annotated[Path, _o("--out", "-o", parser=_output_folder, metavar="PATH", help="Output folder.")] = Path("out")
    save_latents: Annotated[
        bool, _o("--save-latents", help="Also write ID.latents.safetensors (the final latents).")
    ] = False
    no_audio: Annotated[
        bool, _o("--no-audio", help="A model with an audio track (LTX-2): write the MP4 without it.")
    ] = False
    overwrite: Annotated[bool, _o("--overwrite", help="Regenerate items whose outputs exist.")] = False
    profile: Annotated[
        bool,
        _o(
            "--profile",
            help="Profile the denoising: a trace per rank under OUT/profile, time by category in the report.",
        ),
    ] = False


@dataclass
class ParallelArgs:
    nodes: Annotated[int, _o("--nodes", help="Nodes (locally: virtual nodes for topology and bytes).")] = 1
    gpus_per_node: Annotated[
        int, _o("--gpus-per-node", "--gpus", "--ranks", help="Ranks per node: GPUs, or local processes on CPUs.")
    ] = 1
    parallel: Annotated[
        ParallelChoice | None,
        _o(
            "--parallel",
            help=f"{', '.join(n for n, s in STRATEGIES.items() if s.runtime)} (docs/strategies.md) "
            f"[none on 1 rank; on more, the layout search's best exact layout (--layout auto); "
            f"{DEFAULT_CP} under a launcher's ranks].",
            case_sensitive=False,
        ),
    ] = None
    ulysses_degree: Annotated[int | None, _o("--ulysses-degree", help="USP: Ulysses degree [in-node max].")] = None
    executor: Annotated[
        ExecutorChoice,
        _o(
            "--executor",
            help="local processes, a Slurm job, env (this process is a rank torchrun or Kubernetes started), "
            "or auto (env under such a launcher, Slurm when needed).",
        ),
    ] = ExecutorChoice.auto
    replicas: Annotated[
        int, _o("--replicas", min=1, help="Independent model replicas, each taking the next item (--queue).")
    ] = 1
    layout: Annotated[
        LayoutChoice | None, _o("--layout", help="auto: the cost model picks replicas, strategy, CFG and sharding.")
    ] = None
    objective: Annotated[
        ObjectiveChoice, _o("--objective", help="--layout auto: throughput (batch) or latency (one video).")
    ] = ObjectiveChoice.throughput
    allow_reuse: Annotated[bool, _o("--allow-reuse", help="--layout auto: DiTango's lossy reuse may be chosen.")] = (
        False
    )
    hardware: Annotated[
        str | None, _o("--hardware", help="--layout auto: GPU profile or JSON file [the local GPU's, else h20].")
    ] = None
    timeout: Annotated[float, _o("--timeout", help="Per-step collective timeout in seconds.")] = STEP_TIMEOUT_S
    setup_timeout: Annotated[
        float | None,
        _o("--setup-timeout", help=f"Bring-up and waits on rank 0, seconds [max({SETUP_TIMEOUT_S:g}, --timeout)]."),
    ] = None
    attention_backend: Annotated[
        BackendChoice,
        _o(
            "--attention",
            "--attention-backend",
            help="Attention kernel on each GPU: auto is flash3 on Hopper, else flash, else sdpa "
            "(one rank: through diffusers' attention).",
        ),
    ] = BackendChoice.auto
    step_cache: Annotated[
        str | None,
        _o(
            "--step-cache",
            metavar="NAME[:KEY=VALUE,...]",
            help="A diffusers step cache: first-block, pab, taylorseer or magcache, with its config's keys "
            "(e.g. first-block:threshold=0.05).",
        ),
    ] = None

    @property
    def setup_timeout_s(self) -> float:
        return setup_timeout(self.timeout, self.setup_timeout)


@dataclass
class DiTangoArgs:
    planner: Annotated[
        str | None,
        _o(
            "--planner",
            **planner_choice("planner", PLANNERS),
            help=f"DiTango: hpdc (the authors' threshold) or budget (a quota per step) [{RUN_DEFAULTS.planner}].",
        ),
    ] = None
    cache_ratio: Annotated[
        float | None,
        _o("--cache-ratio", help=f"DiTango: attention cells reused on selective steps [{RUN_DEFAULTS.cache_ratio}]."),
    ] = None
    target_psnr: Annotated[
        float | None, _o("--target-psnr", help="DiTango: choose --cache-ratio for this PSNR (dB) vs exact, on item 1.")
    ] = None
    warmup: Annotated[
        int | None, _o("--warmup", help=f"DiTango: exact steps at the start [{RUN_DEFAULTS.warmup}].")
    ] = None
    cooldown: Annotated[
        int | None,
        _o("--cooldown", help=f"DiTango: exact steps at the end [{RUN_DEFAULTS.cooldown}; budget planner: 0]."),
    ] = None
    group_size: Annotated[
        str | None, _o("--group-size", help="DiTango: ranks per group, or 'node' [node on several nodes, else 2].")
    ] = None
    tau_max: Annotated[int | None, _o("--tau-max", help="DiTango: recompute a cache this many steps old.")] = None
    anchor_interval: Annotated[int | None, _o("--anchor-interval", help="DiTango: an anchor step this often.")] = None
    alpha: Annotated[bool | None, _o("--alpha/--no-alpha", help="DiTango: norm-ratio drift factor [off].")] = None
    own_group: Annotated[
        str | None,
        _o(
            "--own-group",
            **planner_choice("own_group", OWN_GROUP_MODES),
            help=f"DiTango: the own group's other ranks decided like remote ones, or always fresh "
            f"[{RUN_DEFAULTS.own_group}].",
        ),
    ] = None
    anchor_when_all: Annotated[
        bool | None,
        _o("--anchor-when-all/--no-anchor-when-all", help="DiTango: all cells computed makes an anchor [off]."),
    ] = None
    reuse: Annotated[
        str | None,
        _o(
            "--reuse",
            **planner_choice("reuse", REUSE_MODES),
            help="DiTango: auto reuses only where the cost model says it saves more than its bookkeeping costs "
            f"(else the exact ring); always as the planner decides [{RUN_DEFAULTS.reuse}].",
        ),
    ] = None
    cache_dtype: Annotated[
        str | None,
        _o(
            "--cache-dtype",
            **flag_choice("--cache-dtype", CACHE_DTYPES),
            help="DiTango: the cache's element type [bfloat16 on CUDA, float32 on CPU].",
        ),
    ] = None
    cache_memory_limit: Annotated[
        str | None, _o("--cache-memory-limit", help="DiTango: cap per rank, e.g. 8GiB [CUDA: free memory].")
    ] = None
    reference: Annotated[
        str | None,
        _o(
            "--reference",
            **flag_choice("--reference", REFERENCES, quoted=True),
            help="exact: also measure vs exact attention, untiled decode.",
        ),
    ] = None

    def given(self) -> list[str]:
        return [f"--{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name) is not None]


@dataclass
class GuidanceArgs:
    cfg_parallel: Annotated[bool, _o("--cfg-parallel", help="The two CFG branches on two rank groups.")] = False
    hybrid: Annotated[bool, _o("--hybrid", help="Hybridiff: pipeline stage in the middle steps.")] = False
    hybrid_k: Annotated[int | None, _o("--hybrid-k", help="Pipeline steps [5 at 50 steps, scaled].")] = None
    hybrid_window: Annotated[int | None, _o("--hybrid-window", help="Slope window L [15 at 50 steps].")] = None
    hybrid_slope: Annotated[float | None, _o("--hybrid-slope", help="Slope threshold [5e-4 at 50 steps].")] = None
    hybrid_tau_cap: Annotated[int | None, _o("--hybrid-tau-cap", help="Latest tau1 [40 at 50 steps].")] = None
    hybrid_split: Annotated[int | None, _o("--hybrid-split", help="First block of segment 2 [half].")] = None
    hybrid_first_text: Annotated[
        str,
        _o("--hybrid-first-text", help="Segment 1's text.", **flag_choice("--hybrid-first-text", FIRST_SEGMENT_TEXTS)),
    ] = FIRST_SEGMENT_TEXTS[0]


@dataclass
class MemoryArgs:
    vae_parallel: Annotated[
        bool | None, _o("--vae-parallel/--no-vae-parallel", help="VAE tiles over the ranks [on with > 1 rank].")
    ] = None
    vae_tiling: Annotated[bool, _o("--vae-tiling", help="Tiled VAE decode (diffusers' tiles) on one rank too.")] = False
    vae_tile: Annotated[
        int | None, _o("--vae-tile", help="VAE tile side, pixels, taken to whole latents (stride ~3/4) [256].")
    ] = None
    shard_weights: Annotated[bool, _o("--shard-weights", help="FSDP2: weights over the ranks.")] = False
    gpu_memory: Annotated[
        str | None, _o("--gpu-memory", help="Pre-flight: memory per GPU, e.g. 80GiB [the GPU's].")
    ] = None


@dataclass
class SlurmArgs:
    partition: Annotated[str | None, _o("--partition", help="Slurm partition.")] = None
    account: Annotated[str | None, _o("--account", help="Slurm account.")] = None
    qos: Annotated[str | None, _o("--qos", help="Slurm QOS.")] = None
    time: Annotated[int, _o("--time", help="Slurm time limit per job, minutes.")] = 60
    cpus_per_task: Annotated[int | None, _o("--cpus-per-task", min=1, help="Slurm CPUs per rank [8].")] = None
    mem: Annotated[str | None, _o("--mem", help="Slurm memory per node, e.g. 200G [the model's need].")] = None
    exclusive: Annotated[bool, _o("--exclusive", help="Slurm: whole nodes (sbatch --exclusive).")] = False
    constraint: Annotated[str | None, _o("--constraint", help="Slurm node constraint.")] = None
    slurm_arg: Annotated[list[str] | None, _o("--slurm-arg", help="Extra sbatch option KEY=VALUE (repeatable).")] = None
    array: Annotated[int, _o("--array", help="Split the items over N array tasks (locally: N rounds).")] = 1
    array_parallelism: Annotated[int | None, _o("--array-parallelism", help="At most K array tasks at once.")] = None
    wait: Annotated[bool, _o("--wait/--no-wait", help="Slurm: wait for the job (default) or return.")] = True


@dataclass
class RunArgs:
    config: Annotated[Path | None, _o("--config", **PATH, help="Run file (.toml, or a report.json's options).")] = None
    json: Annotated[bool, _o("--json", help="Machine-readable output on stdout.")] = False


@dataclass(frozen=True)
class RunOptions:
    """The option groups every run command (generate, check, rehearse) takes, by name."""

    model: ModelArgs
    items: ItemArgs
    output: OutputArgs
    parallel: ParallelArgs
    ditango: DiTangoArgs
    guidance: GuidanceArgs
    memory: MemoryArgs
    slurm: SlurmArgs
    run: RunArgs

    def without(self, names: set[str]) -> RunOptions:
        """These options with the fields in `names` back at their defaults."""
        return RunOptions(**{f.name: without(getattr(self, f.name), names) for f in fields(self)})


def without(group, names: set[str]):
    """`group` (an option group) with the fields in `names` back at their defaults."""
    reset = {f.name: f.default for f in fields(group) if f.name in names}
    return replace(group, **reset) if reset else group


# The groups every run command takes, and each group's section in run files.
GROUPS = (ModelArgs, ItemArgs, OutputArgs, ParallelArgs, DiTangoArgs, GuidanceArgs, MemoryArgs, SlurmArgs, RunArgs)
SECTIONS = {
    ModelArgs: "model", ItemArgs: "items", OutputArgs: "output", ParallelArgs: "parallel", DiTangoArgs: "ditango",
    GuidanceArgs: "guidance", MemoryArgs: "memory", SlurmArgs: "slurm", RunArgs: "run", GenerateArgs: "run",
}  # fmt: skip
