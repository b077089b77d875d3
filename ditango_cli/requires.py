"""Which options mean something only beside others, decided in one place.

An option that would change nothing where it is given (`--objective` without `--layout auto`,
`--partition` on a local run, DiTango's options under another strategy) is never silently
ignored. Typed on the command line, it is refused in one line. Set by a run file whose other
settings the command line changed (a cluster's run file checked with `--executor local`), it
is left out with a note, and the run goes on without it.

Each command has its table of `Rule`s: the options (by field name) and what they need, said
in words and tested on what the command came to (`RunSetting`: the executor, the model's
source, the layout after `--layout auto`, the decode; `SimulateSetting`: what simulate prices).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import typer

from basics.errors import ConfigError
from planner.strategy import Strategy

COMMAND_LINE = "the command line"
TYPED = ("COMMANDLINE", "ENVIRONMENT")  # click's ParameterSource names (typer may vendor click)


@dataclass(frozen=True)
class Given:
    """Where each option a user set came from (COMMAND_LINE, or a run file's path), the flag it
    was typed as (`--no-wait`), and how a note reaches the user; options left at their defaults
    are not in `sources`."""

    sources: Mapping[str, str]
    typed: Mapping[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = lambda text: typer.echo(text, err=True)

    def flag(self, name: str) -> str:
        return self.typed.get(name) or "--" + name.replace("_", "-")

    @classmethod
    def of(
        cls,
        ctx: typer.Context,
        defaults: Mapping[str, object] = {},
        from_file: Mapping[str, object] = {},
        run_file: str = "",
    ) -> Given:
        """The options `ctx`'s command line set, and those a run file set (`from_file`, its values)
        to other values than their `defaults`."""
        sources, typed = {}, {}
        for param in ctx.command.params:
            source = ctx.get_parameter_source(param.name)
            if source is not None and source.name in TYPED:
                sources[param.name] = COMMAND_LINE
                off = ctx.params.get(param.name) is False and getattr(param, "secondary_opts", None)
                typed[param.name] = max(param.secondary_opts if off else param.opts, key=len)
        for name, value in from_file.items():
            if name not in sources and value != defaults.get(name):
                sources[name] = run_file
        return cls(sources, typed)


NOTHING_GIVEN = Given({})


@dataclass(frozen=True)
class Rule:
    """`options` mean something only when `holds(setting)`; `needs` says where they do, read
    after "only applies" ("to --parallel ditango", "with --layout auto")."""

    options: tuple[str, ...]
    needs: str
    holds: Callable[[object], bool]


def check_given(rules: tuple[Rule, ...], given: Given, setting: object) -> set[str]:
    """Refuse (ConfigError) the typed options of a rule that does not hold; say a note for the
    run file's ones and return their names, to be left at their defaults."""
    moot: set[str] = set()
    for rule in rules:
        named = [o for o in rule.options if o in given.sources]
        if not named or rule.holds(setting):
            continue
        typed = [o for o in named if given.sources[o] == COMMAND_LINE]
        shown = ", ".join(given.flag(o) for o in typed or named)
        verb = "applies" if len(typed or named) == 1 else "apply"
        if typed:
            raise ConfigError(f"{shown} only {verb} {rule.needs}")
        given.say(f"note: {shown} from {given.sources[named[0]]} only {verb} {rule.needs}: left out")
        moot.update(named)
    return moot


@dataclass(frozen=True)
class RunSetting:
    """What a `generate`, `check` or `rehearse` came to, for GENERATE_RULES."""

    where: str  # the executor: local, srun, sbatch or env
    model_from: str  # runtime/models/resolve.py model_source: built-in, folder, cache folder or hub
    layout_auto: bool
    strategy: Strategy  # after --layout auto; none on one rank
    world_size: int
    cp_degree: int
    hybrid: bool
    tiled_decode: bool
    step_cache: bool
    vae_parallel: bool | None
    quantized: bool = False  # --quantize other than none


DITANGO_ONLY = ("planner", "cache_ratio", "target_psnr", "warmup", "cooldown", "group_size", "tau_max",
                "anchor_interval", "alpha", "own_group", "anchor_when_all", "cache_dtype",
                "cache_memory_limit", "reuse")  # fmt: skip
HYBRID_TUNING = ("hybrid_k", "hybrid_window", "hybrid_slope", "hybrid_tau_cap", "hybrid_split", "hybrid_first_text")
# What only a submitted job (sbatch) takes: srun steps run in the allocation they are in.
SLURM_JOB = ("partition", "account", "qos", "time", "cpus_per_task", "mem", "exclusive", "constraint", "slurm_arg",
             "array_parallelism", "wait")  # fmt: skip

GENERATE_RULES = (
    Rule(
        ("revision",),
        "to a model from the Hub: a registry name, a repo id, or a cache's models--ORG--NAME folder",
        lambda s: s.model_from in ("hub", "cache folder"),
    ),
    Rule(
        ("model_root", "download"),
        "to a model named by registry name or repo id (a folder is read where it is)",
        lambda s: s.model_from == "hub",
    ),
    Rule(("objective", "hardware", "allow_reuse"), "with --layout auto", lambda s: s.layout_auto),
    Rule(DITANGO_ONLY, "to --parallel ditango", lambda s: s.strategy.reuses),
    Rule(
        ("reference",),
        "to what it measures against exact: --parallel ditango, a --step-cache, --quantize or a tiled decode",
        lambda s: s.strategy.reuses or s.step_cache or s.quantized or s.tiled_decode,
    ),
    Rule(HYBRID_TUNING, "with --hybrid", lambda s: s.hybrid),
    Rule(
        ("vae_tile",), "to a tiled decode: --vae-tiling, or --vae-parallel on several ranks", lambda s: s.tiled_decode
    ),
    Rule(
        ("shard_weights",),
        "over a context-parallel group of several ranks (the weights are sharded over it)",
        lambda s: s.cp_degree > 1,
    ),
    Rule(
        ("vae_parallel",),
        "on more than one rank (one rank decodes alone)",
        lambda s: s.world_size > 1 or s.vae_parallel is False,
    ),
    Rule(
        SLURM_JOB,
        "to a Slurm submission (--executor slurm, or auto where sbatch is on PATH; inside an allocation, "
        "SLURM_JOB_ID set, the ranks are srun steps under the allocation's own settings)",
        lambda s: s.where == "sbatch",
    ),
)


@dataclass(frozen=True)
class SimulateSetting:
    """What a `simulate` prices: the ranking of layouts (`ranking`: --batch or --objective),
    else the strategy table; DiTango among them; a recorded run's plan (--plan)."""

    ranking: bool
    ditango: bool
    plan: bool
    hardware_file: bool


SIMULATE_RULES = (
    Rule(("allow_reuse", "guidance"), "to the ranking of layouts: --batch or --objective", lambda s: s.ranking),
    Rule(
        ("parallel", "group_size", "vae_parallel", "vae_tiling", "shard_weights", "cache_dtype"),
        "to the strategy table (the ranking of --batch and --objective chooses them)",
        lambda s: not s.ranking,
    ),
    Rule(
        ("planner", "own_group", "warmup", "cooldown", "cache_ratio", "cache_dtype", "plan", "plan_item"),
        "where DiTango is priced: ditango in --parallel, or --allow-reuse in the ranking",
        lambda s: s.ditango,
    ),
    Rule(("plan_item",), "with --plan (the report.json the item is in)", lambda s: s.plan),
    Rule(("cache_ratio",), "without --plan (a --plan replays its run's plan)", lambda s: not s.plan),
    Rule(("hardware",), "without --hardware-file (the file's profile is priced)", lambda s: not s.hardware_file),
)
