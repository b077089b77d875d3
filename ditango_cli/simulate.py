"""`ditango simulate`: the cost model's table for a cluster layout."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from basics.errors import ConfigError
from ditango_cli.choices import ObjectiveChoice, QuantizeChoice, canonical_model, planner_choice
from ditango_cli.options import PATH
from ditango_cli.requires import SIMULATE_RULES, Given, SimulateSetting, check_given
from ditango_cli.tables import plain_console, print_tables
from planner.ditango import OWN_GROUP_MODES, PLANNERS, RUN_DEFAULTS
from planner.strategy import STRATEGIES

NodesOpt = Annotated[int, typer.Option("--nodes", help="Nodes of the cluster to price.")]
GpusOpt = Annotated[int, typer.Option("--gpus-per-node", "--gpus", help="GPUs per node.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
ParallelOpt = Annotated[str, typer.Option("--parallel", help="Comma-separated strategies.")]
HwFileOpt = Annotated[Path | None, typer.Option("--hardware-file", **PATH, help="JSON profile overriding --hardware.")]
PlanOpt = Annotated[Path | None, typer.Option("--plan", **PATH, help="report.json of a DiTango run: its plan's shape.")]
PlanItemOpt = Annotated[str | None, typer.Option("--plan-item", help="--plan: the item whose plan [the first].")]
PlannerOpt = Annotated[
    str | None,
    typer.Option(
        "--planner",
        **planner_choice("planner", PLANNERS),
        help=f"DiTango [{RUN_DEFAULTS.planner}; --plan: the run's].",
    ),
]
OwnOpt = Annotated[
    str | None,
    typer.Option(
        "--own-group", **planner_choice("own_group", OWN_GROUP_MODES), help=f"DiTango [{RUN_DEFAULTS.own_group}]."
    ),
]
WarmOpt = Annotated[int | None, typer.Option("--warmup", help="DiTango: exact steps at the start [as recorded: 5].")]
CoolOpt = Annotated[int | None, typer.Option("--cooldown", help="DiTango: exact steps at the end [as recorded].")]
ShardOpt = Annotated[bool, typer.Option("--shard-weights", help="FSDP-shard the transformer over the ranks.")]
VaeParOpt = Annotated[bool | None, typer.Option("--vae-parallel/--no-vae-parallel", help="Default: with >1 rank.")]
TilingOpt = Annotated[bool, typer.Option("--vae-tiling", help="Tiled VAE decode (one process).")]
CacheDtype = Enum("CacheDtype", {"bfloat16": "bfloat16", "float32": "float32"}, type=str)  # type: ignore[misc]
CacheOpt = Annotated[CacheDtype, typer.Option("--cache-dtype", help="DiTango cache element type.")]
# More GPUs than one video can use (32,760 tokens at 480p: 32 a rank); the pricing grows with the square.
MAX_RANKS = 1024
GpuMemOpt = Annotated[str | None, typer.Option("--gpu-memory", help="Per GPU, e.g. 80GiB (default: the profile's).")]
BatchOpt = Annotated[
    str | None,
    typer.Option(
        "--batch",
        metavar="N|FILE",
        help="Rank every layout for a batch: N videos, or a prompt file's items (.txt or .jsonl, as generate "
        "--prompts), each at its own size and steps, queued longest first.",
    ),
]
ObjectiveOpt = Annotated[
    ObjectiveChoice | None, typer.Option("--objective", help="Ranking: throughput or latency [throughput].")
]
ReuseOpt = Annotated[bool, typer.Option("--allow-reuse", help="Ranking: DiTango's lossy reuse may be chosen.")]
InterOpt = Annotated[float | None, typer.Option("--inter-node-gbps", help="Inter-node GB/s per GPU [the profile's].")]
OverlapOpt = Annotated[float | None, typer.Option("--overlap", help="Transfer hidden behind compute, 0-1 [1].")]
GuidanceOpt = Annotated[float | None, typer.Option("--guidance", help="CFG scale; <= 1: one branch [the model's].")]
QuantizeOpt = Annotated[QuantizeChoice, typer.Option("--quantize", help="fp8: the blocks' linear layers in float8.")]
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", help="The repeated block compiled, as on CUDA.")]
AttentionChoice = Enum("AttentionChoice", {v: v for v in ("auto", "flash", "flash3")}, type=str)  # type: ignore[misc]
AttentionOpt = Annotated[
    AttentionChoice, typer.Option("--attention", help="Kernel priced: auto is flash3 where the profile prices it.")
]
# Published end-to-end times (s) next to which the precision section prints the modelled ones:
# (model, width, height, frames, steps, profile, GPUs) -> (seconds, where).
PUBLISHED = {
    ("wan2.1-14b", 1280, 720, 81, 50, "h100", 8): (287.9, "Wan2.1's published T2V-14B 720p time on 8 GPUs"),
}


def simulate(
    ctx: typer.Context,
    model: Annotated[
        str, typer.Option("--model", "-m", help="A registry name (ditango models).", callback=canonical_model)
    ] = "wan2.1-14b",
    nodes: NodesOpt = 4,
    gpus_per_node: GpusOpt = 8,
    hardware: Annotated[str, typer.Option("--hardware", help="h20, h100, h200, a100, l40s.")] = "h20",
    hardware_file: HwFileOpt = None,
    parallel: ParallelOpt = "ring,ulysses,usp,tp,ditango",
    plan: PlanOpt = None,
    plan_item: PlanItemOpt = None,
    cache_ratio: Annotated[
        float, typer.Option("--cache-ratio", help="DiTango without --plan.")
    ] = RUN_DEFAULTS.cache_ratio,
    planner: PlannerOpt = None,
    own_group: OwnOpt = None,
    warmup: WarmOpt = None,
    cooldown: CoolOpt = None,
    group_size: Annotated[
        str | None,
        typer.Option(
            "--group-size", help="DiTango group: ranks or 'node' [as generate: node on several nodes, else 2]."
        ),
    ] = None,
    height: Annotated[int | None, typer.Option("--height", help="[the model's, as generate]")] = None,
    width: Annotated[int | None, typer.Option("--width", help="[the model's, as generate]")] = None,
    frames: Annotated[int | None, typer.Option("--frames", help="[the model's, as generate]")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="[the model's, as generate]")] = None,
    as_json: JsonOpt = False,
    shard_weights: ShardOpt = False,
    vae_parallel: VaeParOpt = None,
    vae_tiling: TilingOpt = False,
    cache_dtype: CacheOpt = CacheDtype.bfloat16,
    gpu_memory: GpuMemOpt = None,
    batch: BatchOpt = None,
    objective: ObjectiveOpt = None,
    allow_reuse: ReuseOpt = False,
    inter_node_gbps: InterOpt = None,
    overlap: OverlapOpt = None,
    guidance: GuidanceOpt = None,
    quantize: QuantizeOpt = QuantizeChoice.none,
    compile: CompileOpt = True,
    attention: AttentionOpt = AttentionChoice.auto,
) -> int:
    """Price strategies on a hardware profile: per-step attention, step and end-to-end time, bytes, peak memory."""
    from planner.comparison import compare_layouts, memory_options, precision_rows, simulate_assumptions
    from planner.cost_model import load_hardware, with_overrides
    from planner.layout import parse_group_size
    from planner.memory import parse_bytes
    from planner.models import VideoSize
    from planner.precision import attention_pricing, check_fp8_hardware
    from runtime.models.registry import REGISTRY

    if model not in REGISTRY:
        raise ConfigError(f"unknown model {model!r} for simulate: use one of {', '.join(REGISTRY)}")
    strategies = [s.strip() for s in parallel.split(",") if s.strip()]
    if not strategies:
        known = ", ".join(n for n, s in STRATEGIES.items() if s.runtime is not None)
        raise ConfigError(f"--parallel {parallel!r} names no strategy; give some of {known}")
    ranking = batch is not None or objective is not None
    reuse = allow_reuse if ranking else any(s in STRATEGIES and STRATEGIES[s].reuses for s in strategies)
    priced = SimulateSetting(ranking, reuse, plan is not None, hardware_file is not None)
    check_given(SIMULATE_RULES, Given.of(ctx), priced)  # no run file: every rule broken is refused
    spec = REGISTRY[model]  # one expert runs at a time: per-step costs are one transformer's (memory: all)
    hw = with_overrides(load_hardware(str(hardware_file) if hardware_file else hardware), inter_node_gbps, overlap)
    check_fp8_hardware(hw, quantize.value)
    attn = attention_pricing(attention.value, hw)  # flash or flash3, as generate's --attention runs
    d = spec.defaults  # one set of defaults: a run of generate with the same options is what is priced
    given = dict(height=height, width=width, frames=frames, steps=steps, guidance=guidance)  # a prompt file's
    height, width, frames, steps = (
        d.height if height is None else height,
        d.width if width is None else width,
        d.frames if frames is None else frames,
        d.steps if steps is None else steps,
    )
    cfg_scale = spec.defaults.cfg_scale if guidance is None else guidance
    check_size(spec.defaults, height, width, frames, steps, cfg_scale)
    if nodes < 1 or gpus_per_node < 1 or nodes * gpus_per_node > MAX_RANKS:
        raise ConfigError(
            f"--nodes and --gpus-per-node must be >= 1 and price at most {MAX_RANKS} GPUs, got "
            f"{nodes} and {gpus_per_node}"
        )
    if group_size is not None:
        parse_group_size(group_size, gpus_per_node)  # checked once here, not once per row
    source = plan_source(plan, planner, own_group, cache_ratio, warmup, cooldown, plan_item)
    size = VideoSize(height, width, frames)
    if ranking:
        from ditango_cli.ranking import batch_items, mix_of, print_ranking
        from planner.search import Problem
        from runtime.items import Overrides

        count, items = batch_items(batch, d, Overrides(**given)) if batch is not None else (1, ())
        if items:  # memory and latency at the largest item, as --layout auto
            largest = max(items, key=lambda it: (it.tokens(), it.steps))
            size, steps, cfg_scale = largest.size, largest.steps, max(it.cfg_scale for it in items)
        problem = Problem(
            spec.shape,
            size,
            steps,
            nodes,
            gpus_per_node,
            count,
            cfg_scale,
            (objective or ObjectiveChoice.throughput).value,
            allow_reuse,
            parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else 0,
            source,
            quantize.value,
            compile,
            attn,
            mix_of(items),
        )
        return print_ranking(hw, problem, model, as_json, batch if items else None)
    memory = memory_options(shard_weights, spec.defaults.cfg_scale, vae_tiling, cache_dtype.value, quantize.value)
    rows, notes = compare_layouts(
        hw,
        spec.shape,
        nodes,
        gpus_per_node,
        strategies,
        group_size,
        size,
        steps,
        source,
        memory,
        vae_parallel,
        parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None,
        compile,
        attn,
    )
    if not rows:
        raise ConfigError("nothing to price: " + "; ".join(notes))
    assumptions = simulate_assumptions(hw, model, spec.shape.tokens(size), steps, source, notes)
    assumptions.update(
        height=height, width=width, frames=frames, quantize=quantize.value, compile=compile, attention=attn
    )
    precision = precision_rows(hw, rows, spec.shape, size, steps, shard_weights)
    published = PUBLISHED.get((model, width, height, frames, steps, hw.name, nodes * gpus_per_node))
    if precision and published:
        precision.update(published_s=published[0], published=published[1])
    if as_json:
        print(json.dumps({"schema": 1, "assumptions": assumptions, "rows": rows, "precision": precision}, indent=2))
        return 0
    console = plain_console()
    console.print(
        f"{model}, {width}x{height}x{frames} ({assumptions['tokens']} tokens), {steps} steps, {hw.name} x "
        f'{gpus_per_node} per node; DiTango from {source.description} ("computed": its share of '
        "attention units fetched, all steps). Bytes are exact counts; times and memory are modelled (see "
        "--json assumptions).",
        highlight=False,
    )
    table = Table(
        "strategy",
        "nodes",
        "attention/step (s)",
        "step (s)",
        "e2e (s)",
        "inter-node GB",
        "intra-node GB",
        "vs best exact",
        "computed",
    )
    memory = Table("strategy", "nodes", "weights GiB/GPU", "peak GiB/GPU", "peak phase", "offloaded", "fits")
    for r in rows:
        table.add_row(
            r["strategy"],
            str(r["nodes"]),
            f"{r['attention_s']:.3f}",
            f"{r['step_s']:.3f}",
            f"{r['e2e_s']:.1f}",
            f"{r['inter_node_bytes'] / 1e9:.1f}",
            f"{r['intra_node_bytes'] / 1e9:.1f}",
            "-" if r["speedup_vs_best_exact"] is None else f"{r['speedup_vs_best_exact']:.2f}x",
            f"{r['ditango']['computed_fraction_all_steps']:.0%}" if "ditango" in r else "-",
        )
        memory.add_row(
            r["strategy"],
            str(r["nodes"]),
            f"{r['weights_bytes'] / 2**30:.1f}",
            f"{r['peak_memory_bytes'] / 2**30:.1f}",
            r["peak_memory_stage"],
            ", ".join(r["offload"]) or "-",
            {None: "-", True: "yes", False: "no"}[r["fits"]],
        )
    plan_notes = dict.fromkeys(n for r in rows for n in r.get("ditango", {}).get("notes", []))
    print_tables(console, table, memory, *precision_table(precision))
    for line in [*(f"skipped: {note}" for note in notes), *(f"note: {n}" for n in plan_notes)]:
        console.print(line)
    return 0


def precision_table(precision: dict) -> list[Table]:
    """The fastest exact layout's modelled time eager and compiled, bf16 and fp8 (flash-attn 2
    class attention), compiled under FlashAttention-3 where the profile prices it, beside a
    published time where one is known for this case."""
    if not precision:
        return []
    names = {"none": "bf16", "none_compiled": "bf16 + compile", "fp8": "fp8", "fp8_compiled": "fp8 + compile"}
    names.update({f"{k}_flash3": f"{v} + FA3" for k, v in names.items()})
    priced = precision["e2e_s"]
    published = ["published (s)"] if "published_s" in precision else []
    title = f"precision: {precision['strategy']} on {precision['nodes']} node(s), e2e (s), modelled"
    table = Table("strategy", "nodes", *(f"{names[k]} (s)" for k in priced), *published, title=title)
    cells = [f"{v:.1f}" for v in priced.values()] + ([f"{precision['published_s']:.1f}"] if published else [])
    table.add_row(precision["strategy"], str(precision["nodes"]), *cells)
    if published:
        table.caption = f"published: {precision['published']}"
    return [table]


def check_size(defaults, height: int, width: int, frames: int, steps: int, guidance: float = 0.0) -> None:
    """The checks generate makes of a video's size, steps and guidance (one line each): simulate
    prices only what a run could make."""
    from runtime.config import Item
    from runtime.items import check_geometry

    item = Item(
        id="simulate",
        prompt="simulate",
        negative_prompt="",
        seed=0,
        height=height,
        width=width,
        frames=frames,
        steps=steps,
        guidance=guidance,
        source="simulate",
        vae_stride=defaults.vae_stride,
        temporal_stride=defaults.temporal_stride,
        patch=defaults.patch,
    )
    check_geometry(item, defaults)


def plan_source(
    plan: Path | None,
    planner: str | None,
    own_group: str | None,
    cache_ratio: float,
    warmup: int | None,
    cooldown: int | None,
    plan_item: str | None = None,
):
    """DiTango's plan for simulate: the recorded shapes of --planner at --cache-ratio, or the
    --plan run's (its planner, own-group mode, warm-up and cool-down unless given; a different
    --planner is an error). Warm-up and cool-down default to the recorded runs' (generate's
    defaults for that planner)."""
    from planner.ditango import run_planner_config
    from planner.plan_shape import recorded_source, report_source

    # validates (a one-line ConfigError); the recorded runs' warm-up and cool-down where not given
    chosen = run_planner_config(
        cache_ratio=cache_ratio, warmup=warmup, cooldown=cooldown, planner=planner, own_group=own_group
    )
    if plan is None:
        return recorded_source(chosen.planner, cache_ratio, chosen.own_group, warmup, cooldown)
    recorded = report_source(plan, own_group, warmup, cooldown, plan_item)
    run_planner = recorded.shapes[0].planner if recorded.shapes else None
    if planner is not None and run_planner is not None and planner != run_planner:
        raise ConfigError(f"--planner {planner}: the --plan run used the {run_planner} planner; drop one of them")
    return recorded
