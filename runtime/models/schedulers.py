"""`--scheduler` and `--flow-shift`: which of diffusers' flow-matching solvers runs an item's
steps, and the shift of its sigma schedule.

A checkpoint brings its own scheduler (`scheduler/scheduler_config.json`: UniPC for Wan,
flow-match Euler for HunyuanVideo). `--scheduler NAME` swaps the class as a diffusers user
does (`Class.from_config(pipe.scheduler.config, ...)`), with the settings that make it a
flow-matching solver; `--flow-shift` sets the shift on whichever class runs (`flow_shift` for
UniPC and DPM++, `shift` for Euler). Wan's authors recommend 3.0 at 480p and 5.0 at 720p;
few-step distilled LoRAs name their own.

Every item is resolved to a concrete (name, shift) before anything runs, so the sidecar
records what made the video and resume compares it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from basics.errors import ConfigError

# name -> (diffusers class, the settings that make it a flow-matching solver)
SOLVERS: dict[str, tuple[str, dict]] = {
    "unipc": ("UniPCMultistepScheduler", {"prediction_type": "flow_prediction", "use_flow_sigmas": True}),
    "euler": ("FlowMatchEulerDiscreteScheduler", {}),
    "dpm++": ("DPMSolverMultistepScheduler",
              {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "algorithm_type": "dpmsolver++"}),
}  # fmt: skip
SHIFT_KEY = {"FlowMatchEulerDiscreteScheduler": "shift"}  # the others call it flow_shift


@dataclass(frozen=True)
class Sampler:
    """An item's solver by name (a SOLVERS key, or the class name of a checkpoint's scheduler
    this module has no name for) and its flow shift."""

    name: str
    flow_shift: float


def _name_of(scheduler) -> str:
    cls = type(scheduler).__name__
    return next((n for n, (c, _) in SOLVERS.items() if c == cls), cls)


def _shift_key(class_name: str) -> str:
    return SHIFT_KEY.get(class_name, "flow_shift")


def sampler_of(scheduler) -> Sampler:
    """What a scheduler as configured is: a checkpoint's own when no option is given."""
    shift = scheduler.config.get(_shift_key(type(scheduler).__name__))
    return Sampler(_name_of(scheduler), float(shift) if isinstance(shift, int | float) else 1.0)


def check(name: str | None, shift: float | None, base, by_sigmas: bool, where: str) -> Sampler:
    """The (name, shift) an item runs with: its own, else the checkpoint's `base` scheduler's;
    `by_sigmas`: the family's loop sets the schedule's sigmas (HunyuanVideo), which only some
    solvers take. A one-line ConfigError for an unknown solver or an unusable shift."""
    own = sampler_of(base)
    name = own.name if name is None else getattr(name, "value", name)  # --scheduler's choice, or a JSONL line's text
    if name not in SOLVERS and name != own.name:
        raise ConfigError(f"{where}: scheduler {name!r} is not one of {', '.join(SOLVERS)}")
    if base.config.get("use_dynamic_shifting") and (name != own.name or shift is not None):
        raise ConfigError(
            f"{where}: the model's scheduler shifts its sigmas by the video's size (dynamic shifting): "
            "drop --scheduler and --flow-shift"
        )
    if shift is not None and (isinstance(shift, bool) or not (isinstance(shift, int | float) and 0 < shift <= 100)):
        raise ConfigError(f"{where}: flow shift must be a number in (0, 100], got {shift!r}")
    if name not in SOLVERS and shift is not None and _shift_key(name) not in base.config:
        raise ConfigError(f"{where}: the model's scheduler {name} has no flow shift to set")
    if by_sigmas and name in SOLVERS:
        import diffusers

        cls = getattr(diffusers, SOLVERS[name][0])
        if "sigmas" not in inspect.signature(cls.set_timesteps).parameters:
            takes = [
                n
                for n, (c, _) in SOLVERS.items()
                if "sigmas" in inspect.signature(getattr(diffusers, c).set_timesteps).parameters
            ]
            raise ConfigError(
                f"{where}: scheduler {name} does not apply to this model, whose pipeline sets the "
                f"schedule's sigmas, which {cls.__name__} does not take; use {' or '.join(takes)}"
            )
    return Sampler(name, own.flow_shift if shift is None else float(shift))


def fresh(base, sampler: Sampler | None):
    """A new scheduler (multistep solvers keep per-run state): `base`'s class and config, or
    `sampler`'s solver built from `base`'s config as diffusers builds one, with its shift."""
    import diffusers

    if sampler is None or (sampler.name == _name_of(base) and sampler == sampler_of(base)):
        return type(base).from_config(base.config)
    class_name, settings = SOLVERS.get(sampler.name, (type(base).__name__, {}))
    cls = getattr(diffusers, class_name)
    config = {k: v for k, v in base.config.items() if k in inspect.signature(cls.__init__).parameters}
    return cls.from_config({**config, **settings, _shift_key(class_name): sampler.flow_shift})
