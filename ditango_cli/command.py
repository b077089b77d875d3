"""A command from option groups (ditango_cli/options.py): `command(*groups)` gives a command
the union of its groups' options, in one --help panel per group, and hands it one object per
group. A run file (`--config run.toml`, or a report.json's recorded `options`) fills in the
options not given on the command line: keys at the top level or in a group's section
(`[ditango]`, `[slurm]`)."""

from __future__ import annotations

import functools
import inspect
import json
import sys
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import get_args, get_type_hints

import typer

from ditango_cli.options import SECTIONS
from planner.errors import ConfigError


def section(group: type) -> str:
    """A group's section in run files (a command's own options: "run")."""
    return SECTIONS.get(group, "run")


# --help shows each group under its own heading.
PANELS = {"model": "Model", "items": "Items", "output": "Output", "parallel": "Parallelism", "ditango": "DiTango",
          "guidance": "Guidance (CFG, Hybridiff)", "memory": "Memory", "slurm": "Slurm", "run": "Run"}  # fmt: skip
# Options a run file may not set, and the report does not record (they say how to show a run).
NOT_RECORDED = ("config", "json", "dry_run", "quiet", "wait_for_lock")


def command(*groups: type):
    """Decorate `fn(*group_objects)`: its command-line signature is every field of `groups`,
    filled from the command line, then the run file, then the defaults."""

    def wrap(fn):
        params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
        for group in groups:
            hints = get_type_hints(group, include_extras=True)
            for f in fields(group):
                for info in get_args(hints[f.name])[1:]:
                    info.rich_help_panel = PANELS[section(group)]
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                                default=default))  # fmt: skip

        @functools.wraps(fn)
        def run(ctx: typer.Context, **values):
            config = values.get("config")
            if config is not None:
                values.update(run_file_values(ctx, config, groups))
            objects = [group(**{f.name: values[f.name] for f in fields(group)}) for group in groups]
            return fn(*objects, options=recorded(values))

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


def run_file_values(ctx: typer.Context, path: Path, groups: tuple[type, ...]) -> dict:
    """The options `path` sets that the command line did not: TOML, or a report's `options`."""
    from runtime.user_files import require_regular_file

    require_regular_file(path, "--config")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text).get("options") if path.suffix == ".json" else _toml().loads(text)
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: no options in it (a report.json records them under 'options')")
    known = {f.name: group for group in groups for f in fields(group)}
    sections = {section(g) for g in groups}
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in sections:
            for sub, v in value.items():
                if known.get(sub) is None or section(known[sub]) != key:
                    raise ConfigError(f"--config {path}: unknown key {sub!r} in [{key}]")
                flat[sub] = v
        elif key in known and key not in NOT_RECORDED:
            flat[key] = value
        else:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are option names with underscores)")
    params = {p.name: p for p in ctx.command.params}
    out = {}
    for key, raw in flat.items():
        source = ctx.get_parameter_source(key)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            continue  # the command line wins
        try:  # typer's own conversion and checks: types, choices, ranges, enums, paths
            out[key] = params[key].process_value(ctx, raw)
        except Exception as exc:  # BadParameter and friends
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            raise ConfigError(f"--config {path}: {key} = {raw!r}: {message}") from None
    return out


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib


def recorded(values: dict) -> dict:
    """JSON-ready effective options for the report (enough to run the same again)."""

    def plain(v):
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return {k: plain(v) for k, v in values.items() if k not in NOT_RECORDED and k != "ctx" and v is not None}
