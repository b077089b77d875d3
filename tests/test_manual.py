"""The manual (docs/, built by MkDocs) against the code: its CLI reference lists every option of
every command, every command example in it and in README.md parses, its strategy table is the
registry's, and the report fields it prints are those a run writes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ditango_cli.app import app
from ditango_cli.manual import cli_reference, commands, root_context, strategy_table
from planner.strategy import STRATEGIES
from runtime.report_fields import ITEM_FIELDS, RUN_FIELDS
from tests.conftest import FAST_ARGV

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPERATORS = {";", "&&", "||", "|", "&", ">", ">>", "2>", "<"}
LAUNCHERS = {"srun", "salloc", "sbatch", "torchrun", "mpirun", "nohup", "time", "env", "exec"}


def test_the_cli_reference_lists_every_option_of_every_command():
    text = cli_reference(app)
    listed = 0
    for name, command, ctx in commands(app):
        assert f"## `ditango {name}`" in text
        for param in command.params:
            if param.get_help_record(ctx) is None:
                continue
            for flag in param.opts + param.secondary_opts:
                assert re.search(rf"<code>[^<]*{re.escape(flag)}\b", text), (name, flag)
                listed += 1
    assert listed > 250  # generate, check, rehearse and simulate alone take well over a hundred


def test_the_strategy_table_is_the_registry():
    rows = strategy_table().splitlines()[2:]
    assert [re.match(r"\| `([^`]+)`", r).group(1) for r in rows] == list(STRATEGIES)


SHELL = {"", "bash", "sh", "shell", "console"}  # a fence's language: shell commands (untagged too)


def examples(text: str) -> list[str]:
    """Every `ditango ...` command in the shell blocks and the inline code of a page."""
    found: list[str] = []
    block: list[str] | None = None  # the lines of the shell block open now
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced and block is not None:
                joined = "\n".join(block).replace("\\\n", " ")
                found += [c for c in joined.splitlines() if re.search(r"(^|[\s/])ditango\s", c)]
            block = [] if not fenced and line.lstrip()[3:].strip() in SHELL else None
            fenced = not fenced
        elif fenced and block is not None:
            block.append(line)
    # inline code that gives options (a bare `ditango status` is a name in prose)
    found += re.findall(r"(?<!`)`(ditango [a-z]+ [^`]*--[^`]*)`", text)
    return found


def ditango_argv(line: str) -> list[list[str]]:
    """The argument lists of the `ditango` commands on a shell line ([...]: optional, left out):
    a command that starts with it, or with a launcher whose program it is."""
    lexer = shlex.shlex(re.sub(r"\s\[[^\]]*\]", "", line), posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens, out, start = list(lexer), [], 0
    while start < len(tokens):
        end = next((j for j in range(start, len(tokens)) if tokens[j] in OPERATORS), len(tokens))
        command = tokens[start:end]
        while command and "=" in command[0] and not command[0].startswith("-"):  # VAR=value before it
            command = command[1:]
        if command and command[0] in LAUNCHERS:
            command = command[next((i for i, t in enumerate(command) if is_ditango(t)), len(command)) :]
        if command and is_ditango(command[0]) and command[1:]:
            out.append(command[1:])
        start = end + 1
    return out


def is_ditango(token: str) -> bool:
    return token == "ditango" or token.endswith("/ditango")


def test_every_command_example_parses():
    group = root_context(app)
    parsed, bad = 0, []
    for page in PAGES:
        for line in examples(page.read_text(encoding="utf-8")):
            for argv in ditango_argv(line):
                command = group.command.get_command(group, argv[0])
                if command is None:
                    bad.append(f"{page.name}: {line.strip()} (no command {argv[0]!r})")
                    continue
                try:  # parsed and converted as a run would be; nothing is invoked
                    command.make_context(argv[0], argv[1:], parent=group)
                except Exception as exc:  # Typer's Click: its UsageError and BadParameter
                    if not hasattr(exc, "format_message"):
                        raise
                    bad.append(f"{page.name}: {line.strip()} ({exc.format_message()})")
                parsed += 1
    assert bad == [], "\n".join(bad)
    assert parsed > 40


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("manual") / "out"
    result = CliRunner().invoke(
        app, ["generate", "--prompt", "a red circle moving left", "--out", str(out), *FAST_ARGV]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    return report, json.loads((out / f"{report['items'][0]['id']}.json").read_text())


@pytest.mark.parametrize("which", ["report", "sidecar"])
def test_a_run_writes_the_fields_the_manual_lists(written, which):
    record, fields = (written[0], RUN_FIELDS) if which == "report" else (written[1], ITEM_FIELDS)
    assert sorted(set(record) - set(fields)) == []  # nothing written that the manual does not list
    assert sorted(k for k, (always, _) in fields.items() if always and k not in record) == []
    if which == "report":
        assert set(record["items"][0]) == set(written[1])  # the sidecar is the item's entry
