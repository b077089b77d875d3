"""`--layout auto`: the layout search (planner/search.py) picks the replicas, the strategy and
its degrees, CFG over two rank groups and weight sharding for `generate`, `check` and
`--dry-run`, says its choice in one line, and the report records it (`layout_choice`).

The video is priced at the batch's largest item; the batch is the items one job (or array
task) runs. Exact layouts only unless reuse is allowed (`--allow-reuse`, or a DiTango option
given): an automatic choice never makes videos lossy behind the user's back. The GPU is the
local one's profile when it has one (planner/cost_model.py HARDWARE), else `--hardware`, else
h20's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import typer

from planner.errors import ConfigError
from planner.user_files import printable


def local_profile() -> str:
    """The HARDWARE profile of this machine's first GPU (by its name), else h20's."""
    import torch

    from planner.reuse import FALLBACK_GPU, device_hardware

    if not torch.cuda.is_available():
        return FALLBACK_GPU
    return device_hardware("cuda", torch.cuda.get_device_name(0)).name


def choose_layout(p, g, d, mem, spec, items, array: int = 1):
    """(p, g, d, mem) with the search's best layout filled in, and its record for the report;
    as given, and None, without --layout auto."""
    if p.layout is None:
        return p, g, d, mem, None
    from ditango_cli.options import ParallelChoice
    from ditango_cli.simulate import plan_source
    from planner.cost_model import load_hardware
    from planner.ditango import RUN_DEFAULTS
    from planner.memory import parse_bytes
    from planner.search import Problem, search, why

    given = [flag for flag, on in (("--parallel", p.parallel is not None), ("--replicas", p.replicas != 1),
                                   ("--ulysses-degree", p.ulysses_degree is not None),
                                   ("--group-size", d.group_size is not None), ("--cfg-parallel", g.cfg_parallel),
                                   ("--shard-weights", mem.shard_weights), ("--hybrid", g.hybrid)) if on]  # fmt: skip
    if given:
        raise ConfigError(
            f"--layout auto chooses {', '.join(given)} itself: give --layout auto or {given[0]}, not both"
        )
    hw = load_hardware(p.hardware or local_profile())
    reuse = p.allow_reuse or any(f != "--reference" for f in d.given())
    ratio = RUN_DEFAULTS.cache_ratio if d.cache_ratio is None else d.cache_ratio
    source = plan_source(None, d.planner, d.own_group, ratio, d.warmup, d.cooldown) if reuse else None
    largest = max(items, key=lambda it: (it.tokens(), it.steps))
    problem = Problem(spec.shape, largest.size, largest.steps, p.nodes, p.gpus_per_node, math.ceil(len(items) / array),
                      max(it.cfg_scale for it in items), p.objective.value, reuse,
                      parse_bytes(mem.gpu_memory, "--gpu-memory") if mem.gpu_memory else 0, source)  # fmt: skip
    choices, notes = search(hw, problem)
    if not choices:
        raise ConfigError(f"--layout auto: no layout of the model fits {p.nodes} x {p.gpus_per_node} GPUs: "
                          + "; ".join(notes))  # fmt: skip
    best, reason = choices[0], why(choices, problem)
    lay = best.layout
    parallel = ParallelChoice(lay.strategy.name) if lay.cp_degree > 1 else None
    p = replace(p, parallel=parallel, replicas=best.replicas, ulysses_degree=lay.ulysses_degree)
    g = replace(g, cfg_parallel=lay.cfg_degree == 2)
    d = replace(d, group_size=None if lay.group_size is None else str(lay.group_size))
    mem = replace(mem, shard_weights=best.shard_weights)
    flags = " ".join(best.flags()) or "(one GPU, no flags)"
    typer.echo(printable(f"layout auto ({problem.objective}, {hw.name}): {flags}; {reason}"), err=True)  # a file's name
    return p, g, d, mem, {"objective": problem.objective, "hardware": hw.name, "batch": problem.batch,
                          "allow_reuse": reuse, **best.to_json(), "why": reason}  # fmt: skip
