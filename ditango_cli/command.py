"""A run command from option groups (ditango_cli/options.py): `command(own)` gives a command
the union of the run groups' options and its own, in one --help panel per group, and hands it
the groups by name (RunOptions) and its own, with the options the user set and where
(ditango_cli/requires.py `Given`). A run file (`--config run.toml`, or a report.json's recorded `options`) fills in the options not given
on the command line: keys at the top level or in a group's section (`[ditango]`, `[slurm]`)."""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import get_args, get_type_hints

import typer

from basics.errors import ConfigError
from basics.user_files import user_path
from ditango_cli.options import GROUPS, SECTIONS, RunOptions, SlurmArgs
from ditango_cli.requires import Given
from runtime.kernels import OLD_NAMES


def section(group: type) -> str:
    """A group's section in run files (a command's own options: "run")."""
    return SECTIONS.get(group, "run")


# --help shows each group under its own heading.
PANELS = {"model": "Model", "items": "Items", "output": "Output", "parallel": "Parallelism", "ditango": "DiTango",
          "guidance": "Guidance (CFG, Hybridiff)", "memory": "Memory", "slurm": "Slurm", "run": "Run"}  # fmt: skip
# Options a run file may not set, and the report does not record (they say how to show a run).
NOT_RECORDED = ("config", "json", "dry_run", "quiet", "wait_for_lock")


def command(own: type | None = None):
    """Decorate `fn(args, [own_args], options=, given=)`, a run command: its command-line
    signature is every field of the run groups (RunOptions, handed over as `args`) and of the
    command's `own` group, filled from the command line, then the run file, then the defaults;
    `options`: what the report records, `given`: which options the user set, and where."""
    groups = (*GROUPS, *([own] if own else []))

    def wrap(fn):
        params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
        for group in groups:
            hints = get_type_hints(group, include_extras=True)
            for f in fields(group):
                for info in get_args(hints[f.name])[1:]:
                    info.rich_help_panel = PANELS[section(group)]
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                params.append(
                    inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name], default=default)
                )

        defaults = {p.name: p.default for p in params}

        @functools.wraps(fn)
        def run(ctx: typer.Context, **values):
            config = joined_batch(values)
            from_file = {} if config is None else run_file_values(ctx, config, groups)
            if values.get("join") is not None:  # the new workers' own shape is the command line's
                from_file = {k: v for k, v in from_file.items() if k not in WORKER_OPTIONS}
            values.update(from_file)
            objects = [group(**{f.name: values[f.name] for f in fields(group)}) for group in groups]
            given = Given.of(ctx, defaults, from_file, str(config))
            args = RunOptions(*objects[: len(GROUPS)])
            return fn(args, *objects[len(GROUPS) :], options=recorded(values), given=given)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


# What a --join does not take from the batch: how many GPUs its workers are and where they run.
WORKER_OPTIONS = frozenset(
    {"nodes", "gpus_per_node", "replicas", "executor", "layout", "objective", "hardware", "allow_reuse"}
    | {f.name for f in fields(SlurmArgs)}
)


def joined_batch(values: dict) -> Path | None:
    """The run file of a command: --config, or with --join OUT the options OUT's batch was begun
    with (the command line's own win; runtime/batch_open.py refuses a run that would make other
    videos). --join's folder is also the output folder."""
    join = values.get("join")
    if join is None:
        return values.get("config")
    if values.get("config") is not None:
        raise ConfigError("--join reads the run's settings from the folder's batch: leave out --config")
    from runtime.batch_open import read_batch
    from runtime.batch_queue import manifest_path

    read_batch(join)  # one line when there is no batch to join
    return manifest_path(join)


def run_file_values(ctx: typer.Context, path: Path, groups: tuple[type, ...]) -> dict:
    """The options `path` sets that the command line did not: TOML, or a report's `options`."""
    from basics.user_files import TEXT_LIMIT, check_text, parse_json, read_text

    try:  # a report (long: its items) or a run file
        text = read_text(path, "--config", TEXT_LIMIT)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    if path.suffix == ".json":
        data = parse_json(text, f"--config {path}")
        data = data.get("options") if isinstance(data, dict) else None
    else:
        try:
            data = _toml().loads(text)
        except RecursionError:
            raise ConfigError(f"--config {path}: TOML nested too deeply") from None
        except ValueError as exc:
            raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
        check_text(data, f"--config {path}")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: no options in it (a report.json records them under 'options')")
    known = {f.name: group for group in groups for f in fields(group)}
    sections = {section(g) for g in groups}
    flat: dict[str, object] = {}
    for key, value in data.items():
        for name in (key, *(value if isinstance(value, dict) and key in sections else ())):
            if name in NOT_RECORDED:  # how to show a run, not what it makes: the command line's
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"--config {path}: {name!r} is not a run setting; give {flag} on the command line")
        if isinstance(value, dict) and key in sections:
            for sub, v in value.items():
                if known.get(sub) is None or section(known[sub]) != key:
                    raise ConfigError(f"--config {path}: unknown key {sub!r} in [{key}]")
                flat[sub] = v
        elif key in known:
            flat[key] = value
        else:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are option names with underscores)")
    _from_folder(flat, path.parent)
    params = {p.name: p for p in ctx.command.params}
    out = {}
    for key, raw in flat.items():
        if isinstance(raw, str):  # a value an option had under an older name
            raw = RENAMED_VALUES.get(key, {}).get(raw, raw)
        if problem := _wrong_type(params[key], raw):  # typer would convert true to 1, 5 to "5"
            raise ConfigError(f"--config {path}: {key} = {raw!r}: {problem}")  # wrong even where overridden
        source = ctx.get_parameter_source(key)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            continue  # the command line wins
        try:  # typer's own conversion and checks: types, choices, ranges, enums, paths
            out[key] = params[key].process_value(ctx, raw)
        except Exception as exc:  # BadParameter and friends
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            raise ConfigError(f"--config {path}: {key} = {raw!r}: {message}") from None
    return out


PATH_OPTIONS = ("prompts", "image", "model_root", "out")  # the options that name files or folders
RENAMED_VALUES = {"attention_backend": OLD_NAMES}  # --attention torch is sdpa since the rename


def _from_folder(flat: dict, folder: Path) -> None:
    """A run file's relative paths are relative to its folder (wherever the command runs): the
    paths of PATH_OPTIONS, each LoRA's, a hardware profile file's and a step cache's
    mag_ratios; and so is a relative `model` that names a folder there (else it is a name)."""
    from planner.cost_model import HARDWARE
    from runtime.models.adapters import beside
    from runtime.step_cache_options import paths_beside

    for key in PATH_OPTIONS:
        if isinstance(flat.get(key), str) and flat[key] and not user_path(flat[key], key).is_absolute():
            flat[key] = str(folder / flat[key])
    for key in ("lora", "lora_2"):
        if isinstance(flat.get(key), list):
            flat[key] = [beside(text, folder) if isinstance(text, str) else text for text in flat[key]]
    hardware = flat.get("hardware")
    if isinstance(hardware, str) and hardware.lower() not in HARDWARE and hardware:
        flat["hardware"] = str(folder / user_path(hardware, "hardware"))
    if isinstance(flat.get("step_cache"), str):
        flat["step_cache"] = paths_beside(flat["step_cache"], folder)
    model = flat.get("model")
    if _a_folder(model, folder):
        flat["model"] = str(folder / model)


def _a_folder(model, folder: Path) -> bool:
    """Whether `model` names a folder (relative to `folder`) rather than a registered model,
    which wins over a folder of the same name, as --model resolves it."""
    from runtime.models.registry import REGISTRY

    return isinstance(model, str) and model not in REGISTRY and (folder / user_path(model, "--model")).is_dir()


def _wrong_type(param, raw) -> str | None:
    """Why a run file's value is not of the option's type (None: it is). Typer converts what
    it is given (`steps = true` to 1, `prompt = 5` to "5", `steps = 2.5` to 2): a file's values
    are typed, so a value of another type is a mistake to name, not to convert."""
    if param.multiple or param.nargs != 1:
        if not isinstance(raw, list):
            return "expected a list"
        return next((p for p in (_wrong_type_one(param, v) for v in raw) if p), None)
    return _wrong_type_one(param, raw)


def _wrong_type_one(param, raw) -> str | None:
    kind = _python_type(param)
    if kind is bool:
        ok, want = isinstance(raw, bool), "true or false"
    elif kind is int:
        ok, want = isinstance(raw, int) and not isinstance(raw, bool), "an integer"
    elif kind is float:
        ok, want = isinstance(raw, (int, float)) and not isinstance(raw, bool), "a number"
    else:  # text, paths, choices, sizes such as "80GiB"
        ok, want = isinstance(raw, str), "a string"
    return None if ok else f"expected {want}"


def _python_type(param) -> type:
    """The Python type an option converts to: typer's annotation (its vendored click keeps it
    there), else click's parameter type."""
    if getattr(param, "is_flag", False):
        return bool
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None and isinstance(descriptor.annotation, type):
        return descriptor.annotation
    names = {c.__name__ for c in type(getattr(param, "type", None)).__mro__}
    return next(
        (t for name, t in (("BoolParamType", bool), ("IntParamType", int), ("FloatParamType", float)) if name in names),
        str,
    )


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib


def recorded(values: dict) -> dict:
    """JSON-ready effective options for the report (enough to run the same again, from any
    folder: paths absolute, a model folder's too)."""

    def plain(v):
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, Path):
            return str(user_path(v, "").absolute())
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    kept = {k: plain(v) for k, v in values.items() if k not in NOT_RECORDED and k != "ctx" and v is not None}
    if _a_folder(kept.get("model"), Path.cwd()):
        kept["model"] = str(user_path(kept["model"], "--model").absolute())
    return kept
