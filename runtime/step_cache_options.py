"""`--step-cache NAME[:key=value,...]`: the caches and their options, parsed and checked
where the option is given (a value out of range is one line then, not a failure inside an
item); runtime/step_cache.py runs them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import read_json_file, user_path


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not sep or int(lo) > int(hi):
        raise ValueError(text)
    return int(lo), int(hi)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # nan passes every comparison, and inf is no threshold
        raise ValueError(text)
    return value


def _fraction(text: str) -> float:
    value = _finite(text)
    if not 0 <= value <= 1:
        raise ValueError(text)
    return value


def _bool(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false"):
        raise ValueError(text)
    return text.lower() in ("1", "true")


def _dtype(text: str) -> str:
    if text not in ("float32", "bfloat16"):
        raise ValueError(text)
    return text


def _path(text: str) -> str:
    return str(user_path(text, "mag_ratios", resolve=True))


# Per cache: its keys (as in diffusers' config classes) with their parsers, and our defaults
# where diffusers' would do nothing (PAB skips no layer unless a skip range is given).
KEYS: dict[str, dict] = {
    "first-block": {"threshold": _finite},
    "pab": {
        "spatial_attention_block_skip_range": int,
        "spatial_attention_timestep_skip_range": _range,
        "cross_attention_block_skip_range": int,
        "cross_attention_timestep_skip_range": _range,
    },
    "taylorseer": {
        "cache_interval": int,
        "disable_cache_before_step": int,
        "disable_cache_after_step": int,
        "max_order": int,
        "taylor_factors_dtype": _dtype,
    },
    "magcache": {"threshold": _finite, "max_skip_steps": int, "retention_ratio": _fraction, "mag_ratios": _path},
}
DEFAULTS: dict[str, dict] = {"pab": {"spatial_attention_block_skip_range": 2}}
EXAMPLE = {"first-block": "threshold=0.05", "pab": "spatial_attention_block_skip_range=2",
           "taylorseer": "cache_interval=5", "magcache": "threshold=0.06"}  # fmt: skip


@dataclass(frozen=True)
class StepCacheSpec:
    """`--step-cache NAME[:key=value,...]`, validated: the cache and its options."""

    name: str
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.name not in KEYS:
            raise ConfigError(f"--step-cache must be one of {', '.join(KEYS)}, got {self.name!r}")
        for key, value in self.options:
            if key not in KEYS[self.name]:
                raise ConfigError(
                    f"--step-cache {self.name} has no option {key!r}; its options: {', '.join(KEYS[self.name])}"
                )
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"--step-cache {self.name}: {key} must be >= 0, got {value}")
        opts = self.settings
        if self.name == "taylorseer" and opts.get("cache_interval", 5) < 1:
            raise ConfigError("--step-cache taylorseer: cache_interval must be >= 1 (1 computes every step)")
        if self.name == "taylorseer" and opts.get("disable_cache_before_step", 3) < 1:
            raise ConfigError(
                "--step-cache taylorseer: disable_cache_before_step must be >= 1 (a step to extrapolate from)"
            )
        if self.name == "pab":
            for key in ("spatial_attention_block_skip_range", "cross_attention_block_skip_range"):
                if opts.get(key) is not None and opts[key] < 1:
                    raise ConfigError(f"--step-cache pab: {key} must be >= 1 (1 skips nothing)")
        if "mag_ratios" in opts:
            if not Path(opts["mag_ratios"]).is_file():
                raise ConfigError(f"--step-cache magcache: mag_ratios {opts['mag_ratios']} is not a file")
            load_mag_ratios(opts["mag_ratios"])  # a bad file fails here, not on the ranks

    @property
    def settings(self) -> dict:
        """The options in force: ours where given, else DEFAULTS (diffusers' for the rest)."""
        return {**DEFAULTS.get(self.name, {}), **dict(self.options)}

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings.items()},
        }


def parse_step_cache(text: str) -> StepCacheSpec:
    """'first-block:threshold=0.05' -> StepCacheSpec; a one-line ConfigError otherwise."""
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in KEYS:
        raise ConfigError(
            f"--step-cache must be one of {', '.join(KEYS)} (e.g. first-block:threshold=0.05), got {name!r}"
        )
    options = []
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key in dict(options):
            raise ConfigError(f"--step-cache {name}: {key} is given twice")
        if not sep or key not in KEYS[name]:
            raise ConfigError(
                f"--step-cache {name}: {part!r} is not key=value with a key of {', '.join(KEYS[name])} "
                f"(e.g. {name}:{EXAMPLE[name]})"
            )
        try:
            options.append((key, KEYS[name][key](value.strip())))
        except ValueError:
            want = {_finite: " (a finite number)", _fraction: " (a number from 0 to 1)", int: " (an integer)"}
            raise ConfigError(
                f"--step-cache {name}: {key}={value.strip()!r} is not valid{want.get(KEYS[name][key], '')}"
            ) from None
    return StepCacheSpec(name, tuple(options))


def paths_beside(text: str, folder: Path) -> str:
    """A --step-cache text that a file in `folder` names (a run file), its relative mag_ratios
    path taken from `folder`."""
    name, sep, rest = text.partition(":")
    parts = []
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        value = value.strip()
        if key.strip().replace("-", "_") == "mag_ratios" and eq and value:
            try:
                relative = not user_path(value, "mag_ratios").is_absolute()
            except ConfigError:
                relative = False  # said in one line where it is parsed
            part = f"{key}={folder / value}" if relative else part
        parts.append(part)
    return name + sep + ",".join(parts)


def load_mag_ratios(path: str) -> list[float]:
    try:
        ratios = read_json_file(Path(path), "--step-cache magcache: mag_ratios")
    except FileNotFoundError:
        raise ConfigError(f"--step-cache magcache: mag_ratios {path}: file not found") from None
    numbers = (
        isinstance(ratios, list)
        and ratios
        and all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in ratios)
    )
    if not numbers:
        raise ConfigError(f"--step-cache magcache: mag_ratios {path} is not a JSON list of finite positive numbers")
    return [float(r) for r in ratios]
