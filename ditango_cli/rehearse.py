"""`ditango rehearse`: a generate command's rank program at real shapes, without a GPU or weights
(runtime/rehearse/), checked against the memory model and planner/traffic.py."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Annotated

from rich.table import Table

from basics.errors import ConfigError
from ditango_cli.choices import _o
from ditango_cli.command import command
from ditango_cli.options import RunOptions
from ditango_cli.requires import Given
from ditango_cli.run_config import build_run_config
from ditango_cli.tables import plain_console, print_tables
from planner.memory import GIB, parse_bytes

EXIT_PROBLEMS = 1
DEFAULT_GPU = "80GiB"  # an H100-80GB, unless --gpu-memory says otherwise


@dataclass
class RehearseArgs:
    all_ranks: Annotated[bool, _o("--all-ranks", help="Every rank, not only those whose shapes differ.")] = False


@command(RehearseArgs)
def rehearse(args: RunOptions, run: RehearseArgs, options: dict, given: Given) -> int:
    """Run the first item's rank program at the real model's shapes on fake GPUs (no weights, no
    GPU): per rank the peak memory by phase against the memory model, the bytes each step
    receives by link against the cost model's count, and any problem found. Exit 1 on a problem."""
    from runtime.memory_plan import plan_memory
    from runtime.models.families import FAMILIES
    from runtime.models.registry import REGISTRY
    from runtime.models.resolve import resolve_model
    from runtime.rehearse import rehearse as run_rehearsal

    if args.model.device.value == "cpu":
        raise ConfigError("--device cpu: a rehearsal runs the GPU program (fake CUDA); drop --device")
    items, memory = args.items, args.memory
    if items.prompt is None and items.prompts is None:
        items = replace(items, prompt="a rehearsal")  # the text decides nothing: every prompt is the longest
    named = REGISTRY.get(args.model.model)
    spec = named if named is not None else resolve_model(args.model.model, args.model.model_root).spec
    why = getattr(FAMILIES[spec.family], "NOT_REHEARSED", None)  # a family whose rehearsal is not written yet
    if why:  # before the plan is said
        raise ConfigError(f"{spec.name} cannot be rehearsed yet: {why}")
    gpu_bytes = parse_bytes(memory.gpu_memory or DEFAULT_GPU, "--gpu-memory")
    args = replace(args, items=items, memory=replace(memory, gpu_memory=memory.gpu_memory or DEFAULT_GPU))
    # No GPU job runs here: the torch build does not matter (`warn` silent), nothing downloads.
    cfg, resolved = build_run_config(
        args, where="sbatch", create_out=False, weights=False, warn=lambda text: None, given=given
    )
    spec = REGISTRY[cfg.model] if resolved is None else resolved.spec
    path = None if resolved is None or spec.builtin else resolved.path
    if resolved is None and args.model.model not in REGISTRY:
        path = resolve_model(args.model.model, args.model.model_root).path
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.dtype or "bfloat16"]
    cfg = plan_memory(cfg, spec.shape, gpu_bytes, dtype_bytes, cfg.model)  # what each rank's pre-flight decides
    if cfg.attention_backend in ("auto", "flash", "flash3"):
        cfg = replace(cfg, attention_backend="sdpa")  # torch's flash kernel: flash-attn's have no fake kernel
    if cfg.replicas > 1:
        cfg = replace(cfg, replicas=1)  # every replica runs the same program
    err = plain_console(stderr=True, soft_wrap=True)
    world = cfg.layout.world_size

    started = time.monotonic()

    def progress(report: dict) -> None:
        took = time.monotonic() - started
        said = f"rank {report['rank']}/{world} rehearsed: {len(report['problems'])} problem(s), {took:.0f} s elapsed"
        err.print(said, highlight=False)

    report = run_rehearsal(cfg, spec, path, gpu_bytes, run.all_ranks, progress)
    if args.run.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)
    return EXIT_PROBLEMS if report["problems"] else 0


def show(report: dict) -> None:
    console = plain_console(width=None if sys.stdout.isatty() else 120)  # piped: no column cut to 80
    item, layout = report["item"], report["layout"]
    console.print(
        f"{report['model']} {item['width']}x{item['height']}x{item['frames']} ({item['tokens']} tokens), "
        f"{layout['nodes']}x{layout['gpus_per_node']} GPUs of {report['gpu_memory_bytes'] / GIB:.0f} GiB, "
        f"{layout['strategy']}; steps rehearsed: "
        + ", ".join(f"{s['step']} ({s['kind']})" for s in report["steps_rehearsed"])
        + (f"; offloaded: {', '.join(report['offload'])}" if report["offload"] else ""),
        highlight=False,
    )
    table = Table(
        "rank",
        "node",
        "load",
        "encode",
        "denoise",
        "decode",
        "inter GB",
        "intra GB",
        "problems",
        title="per step and phase: traced/modelled (GiB; GB received per step)",
    )
    for rank in report["ranks"]:
        cells = []
        for phase in ("load", "encode", "denoise", "decode"):
            got = rank["phases"].get(phase)
            cells.append("-" if got is None else f"{got['traced_bytes'] / GIB:.1f}/{got['modelled_bytes'] / GIB:.1f}")
        b, mb = rank["bytes_per_step"], rank["modelled_bytes_per_step"]
        links = [f"{b[k] / 1e9:.2f}/{mb[k] / 1e9:.2f}" for k in ("inter_node_bytes", "intra_node_bytes")]
        table.add_row(str(rank["rank"]), str(rank["node"]), *cells, *links, str(len(rank["problems"])))
    print_tables(console, table)
    for line in report["problems"]:
        console.print(f"problem: {line}", highlight=False, markup=False)
    if not report["problems"]:
        console.print("no problem found", highlight=False)
