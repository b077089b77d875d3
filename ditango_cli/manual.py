"""The manual's pages that are read off the code, so they cannot drift from it: the CLI
reference (every command of the Typer app with every option, as `--help` gives them) and the
strategy table (planner/strategy.py's registry). The site's build (docs/hooks.py) adds them
as pages; tests/test_manual.py holds them to the code."""

from __future__ import annotations

import html

import typer

from planner.strategy import STRATEGIES


def _cell(text: str) -> str:
    """A markdown table cell: one line, HTML-escaped, a pipe as its entity (the table's
    separator otherwise)."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "&#124;")


def root_context(app: typer.Typer):
    """The Click context of `ditango` itself (Typer's own Click: its classes, not click's)."""
    group = typer.main.get_command(app)
    return group.context_class(group, info_name="ditango")


def commands(app: typer.Typer) -> list[tuple]:
    """(name, command, context) of every command of `app`, in the order `--help` lists them."""
    root = root_context(app)
    out = []
    for name in root.command.list_commands(root):
        command = root.command.get_command(root, name)
        out.append((name, command, command.context_class(command, info_name=name, parent=root)))
    return out


def cli_reference(app: typer.Typer) -> str:
    """Markdown: per command its help and a table of its arguments and options by panel."""
    lines = [
        "# CLI reference",
        "",
        "Every command and option of `ditango`, read from the command-line app itself when this",
        "site is built (what `ditango COMMAND --help` prints).",
        "",
    ]
    for name, command, ctx in commands(app):
        lines += [f"## `ditango {name}`", "", (command.help or "").strip(), ""]
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in command.params:
            record = param.get_help_record(ctx)
            if record is None or getattr(param, "hidden", False):
                continue
            panel = getattr(param, "rich_help_panel", None) or (
                "Arguments" if param.param_type_name == "argument" else "Options"
            )
            panels.setdefault(panel, []).append(record)
        for panel, records in panels.items():
            lines += [f"**{panel}**", "", "| option | what it does |", "|---|---|"]
            lines += [f"| <code>{_cell(flags)}</code> | {_cell(text)} |" for flags, text in records]
            lines.append("")
    return "\n".join(lines)


def strategy_table() -> str:
    """Markdown: the registered strategies, what each is and what it takes."""
    rows = ["| `--parallel` | what it is | options | reuses | splits |", "|---|---|---|---|---|"]
    for name, s in STRATEGIES.items():
        options = ", ".join(f"`--{o.replace('_', '-')}`" for o in s.options) or "-"
        splits = "weights" if s.splits_weights else "tokens" if s.runtime else "nothing"
        rows.append(f"| `{name}` | {_cell(s.summary)} | {options} | {'yes' if s.reuses else 'no'} | {splits} |")
    return "\n".join(rows)
