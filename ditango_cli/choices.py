"""The values the command-line options take: their fixed choices (each an Enum of strings, or a
string option refused in the words of the layer that owns it) and the canonical name of a
model. ditango_cli/options.py declares the options with them."""

from __future__ import annotations

from enum import Enum

import typer

from basics.errors import ConfigError
from planner.precision import QUANTIZE
from planner.search import OBJECTIVES
from planner.strategy import STRATEGIES
from runtime.config import QUEUE_MODES
from runtime.kernels import BACKENDS
from runtime.models.loading import DTYPES
from runtime.models.registry import ALIASES, REGISTRY
from runtime.models.schedulers import SOLVERS


def canonical_model(name: str) -> str:
    """A registry alias (wan2.2-a14b), or an entry's Hugging Face repo id without a revision, as
    the entry's name."""
    if not name.strip():
        raise ConfigError("--model is empty; give a registry name (ditango models), a repo id or a folder")
    return ALIASES.get(name) or next((s.name for s in REGISTRY.values() if s.repo_id == name), name)


def _choices(name: str, values) -> type[Enum]:
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


DeviceChoice = _choices("DeviceChoice", ("auto", "cpu", "cuda"))
DTypeChoice = _choices("DTypeChoice", DTYPES)
ParallelChoice = _choices("ParallelChoice", STRATEGIES)
ExecutorChoice = _choices("ExecutorChoice", ("local", "slurm", "env", "auto"))
BackendChoice = _choices("BackendChoice", BACKENDS)
SolverChoice = _choices("SolverChoice", tuple(SOLVERS))
LayoutChoice = _choices("LayoutChoice", ("auto",))
ObjectiveChoice = _choices("ObjectiveChoice", OBJECTIVES)
QuantizeChoice = _choices("QuantizeChoice", QUANTIZE)
QueueChoice = _choices("QueueChoice", QUEUE_MODES)
CACHE_DTYPES = ("float32", "bfloat16")  # DiTangoOptions.cache_dtype
REFERENCES = ("exact",)


def _o(*names: str, **kwargs) -> typer.models.OptionInfo:
    return typer.Option(*names, **kwargs)


def fixed_choice(choices, refuse) -> dict:
    """typer.Option arguments of a fixed-choice option whose value stays a string: shown as
    [a|b] in --help, and refused with the message its layer gives (`refuse(value)`), so that a
    run file and the command line read the same words."""

    def parse(value: str) -> str:
        if value not in choices:
            raise typer.BadParameter(refuse(value))
        return value

    return {"parser": parse, "metavar": f"[{'|'.join(choices)}]"}


def flag_choice(flag: str, choices, quoted: bool = False) -> dict:
    """Refused as "--flag must be a or b, got 'x'" (`quoted`: the choices in quotes)."""
    legal = " or ".join(repr(c) if quoted else c for c in choices)
    return fixed_choice(choices, lambda v: f"{flag} must be {legal}, got {v!r}")


def planner_choice(name: str, choices) -> dict:
    """A PlannerConfig field's choices, refused as PlannerConfig refuses them."""
    return fixed_choice(choices, lambda v: f"planner {name}={v!r} is out of range; legal: {' or '.join(choices)}")
