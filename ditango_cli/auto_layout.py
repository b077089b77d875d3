"""`--layout auto`: the layout search (planner/search.py) picks the replicas, the strategy and
its degrees, CFG over two rank groups and weight sharding for `generate`, `check` and
`--dry-run`, says its choice in one line, and the report records it (`layout_choice`). A run
on more than one GPU that names none of the options that shape a layout (`--parallel`,
`--replicas`, `--cfg-parallel`, ...) is laid out so too (`by_default` in the record); naming a
strategy keeps it, and a launcher's ranks (torchrun) default to ring.

Throughput prices every item of the batch on each layout (its size, steps and CFG scale) and
schedules them as the run will: with the shared queue (`--queue shared`), every replica of every
array task pulls the next item, longest first; with the static split, each array task's share
in rounds of the largest item. Memory, and the latency objective, take the largest item; a
layout must take every item (enough tokens for its ranks, two CFG branches for
cfg-parallel). Exact layouts only unless reuse is allowed (`--allow-reuse`, or a DiTango option
given): an automatic choice never makes videos lossy behind the user's back. The GPU is the
local one's profile when it has one (planner/cost_model.py HARDWARE), else `--hardware`, else
h20's; `--quantize fp8` on a profile without an FP8 peak is refused (planner/precision.py).
Attention is priced as the run's `--attention` runs it: flash3, or auto on a profile with a
`flash3_efficiency` (Hopper), under FlashAttention-3; sdpa, flash and reference as flash-attn 2.
"""

from __future__ import annotations

from dataclasses import replace

from basics.errors import ConfigError
from basics.user_files import printable


def local_profile() -> str:
    """The HARDWARE profile of this machine's first GPU (by its name), else h20's."""
    import torch

    from planner.reuse import FALLBACK_GPU, device_hardware

    try:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (AssertionError, RuntimeError):  # a CUDA that says it is there and is not (no driver)
        name = None
    return FALLBACK_GPU if name is None else device_hardware("cuda", name).name


def layout_flags(args) -> list[str]:
    """The options given that shape the layout (what --layout auto would choose itself)."""
    parallel, guidance, ditango, memory = args.parallel, args.guidance, args.ditango, args.memory
    return [
        flag
        for flag, on in (
            ("--parallel", parallel.parallel is not None),
            ("--replicas", parallel.replicas != 1),
            ("--ulysses-degree", parallel.ulysses_degree is not None),
            ("--group-size", ditango.group_size is not None),
            ("--cfg-parallel", guidance.cfg_parallel),
            ("--shard-weights", memory.shard_weights),
            ("--hybrid", guidance.hybrid),
        )
        if on
    ]


def searched_by_default(args, launched: bool) -> bool:
    """Whether a run without --layout is laid out by the search: more than one GPU, and none of
    the options that shape a layout given (naming a strategy keeps it). Not under a launcher's
    ranks (torchrun: its ranks are one replica, so the strategy defaults to ring there)."""
    parallel = args.parallel
    return not launched and parallel.nodes * parallel.gpus_per_node > 1 and not layout_flags(args)


def choose_layout(args, spec, items, array: int = 1, queue: str = "shared", launched: bool = False):
    """`args` (RunOptions) with the search's best layout filled in, its record for the report
    and the line that says it (said once the run's checks have passed): under --layout auto, or
    by default (`searched_by_default`); as given, None and None, otherwise. `array`: the array
    tasks sharing the batch; `queue`: --queue, shared or static; `launched`: the ranks are a
    launcher's (--executor env)."""
    parallel, guidance, ditango, memory = args.parallel, args.guidance, args.ditango, args.memory
    by_default = parallel.layout is None and searched_by_default(args, launched)
    if parallel.layout is None and not by_default:
        return args, None, None
    from ditango_cli.choices import ParallelChoice
    from ditango_cli.simulate import plan_source
    from planner.cost_model import load_hardware
    from planner.ditango import RUN_DEFAULTS
    from planner.memory import parse_bytes
    from planner.precision import attention_pricing
    from planner.search import Problem, search, why

    if given := layout_flags(args):
        raise ConfigError(
            f"--layout auto chooses {', '.join(given)} itself: give --layout auto or {given[0]}, not both"
        )
    hw = load_hardware(parallel.hardware or local_profile())
    reuse = parallel.allow_reuse or any(f != "--reference" for f in ditango.given())
    ratio = RUN_DEFAULTS.cache_ratio if ditango.cache_ratio is None else ditango.cache_ratio
    source = (
        plan_source(None, ditango.planner, ditango.own_group, ratio, ditango.warmup, ditango.cooldown)
        if reuse
        else None
    )
    largest = max(items, key=lambda it: (it.tokens(), it.steps))
    problem = Problem(
        spec.shape,
        largest.size,
        largest.steps,
        parallel.nodes,
        parallel.gpus_per_node,
        len(items),
        max(it.cfg_scale for it in items),
        parallel.objective.value,
        reuse,
        parse_bytes(memory.gpu_memory, "--gpu-memory") if memory.gpu_memory else 0,
        source,
        args.model.quantize.value,
        args.model.compile is not False,  # unset: on, as on every GPU a profile prices
        attention_pricing(parallel.attention_backend.value, hw),
        tuple((it.size, it.steps, it.cfg_scale) for it in items),
        array,
        queue,
    )
    choices, notes = search(hw, problem)
    if not choices:
        name = "the layout search (no --parallel given)" if by_default else "--layout auto"
        raise ConfigError(
            f"{name}: no layout of the model fits {parallel.nodes} x {parallel.gpus_per_node} GPUs: " + "; ".join(notes)
        )
    best, reason = choices[0], why(choices, problem)
    lay = best.layout
    strategy = ParallelChoice(lay.strategy.name) if lay.cp_degree > 1 else None
    args = replace(
        args,
        parallel=replace(parallel, parallel=strategy, replicas=best.replicas, ulysses_degree=lay.ulysses_degree),
        guidance=replace(guidance, cfg_parallel=lay.cfg_degree == 2),
        ditango=replace(ditango, group_size=None if lay.group_size is None else str(lay.group_size)),
        memory=replace(memory, shard_weights=best.shard_weights),
    )
    flags = " ".join(best.flags()) or "(one GPU, no flags)"
    if by_default:
        head = f"layout (no --parallel given: the search's best{'' if reuse else ' exact'} one, "
    else:
        head = "layout auto ("
    head += f"{problem.objective}, {hw.name})"
    tail = "; name a --parallel strategy to choose it yourself" if by_default else ""
    return (
        args,
        {
            "objective": problem.objective,
            "hardware": hw.name,
            "batch": problem.count,  # every array task's items
            "workers": problem.workers,
            "queue": problem.queue,
            "allow_reuse": reuse,
            "by_default": by_default,  # no --layout auto: no strategy named on more than one GPU
            **best.to_json(),
            "why": reason,
        },
        printable(f"{head}: {flags}; {reason}{tail}"),  # a file's name
    )
