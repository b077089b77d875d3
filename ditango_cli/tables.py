"""Tables on a terminal of any width: ids, names and numbers are never cut.

rich shrinks a table to the console, cutting cells with "…". Here every column is as wide as
its widest cell, except the free-text ones (`WRAPPED`: prompts, errors, paths, lists), which
wrap; when even that is wider than the console, each row is stacked instead: its first cell on
a line, then one `header: value` line per other cell, as wide as the console. Nothing is cut;
`--json` gives every value too.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from basics.user_files import printable


class PlainConsole(Console):
    """A console that prints text as it is: ids, prompts, paths and errors are the user's, and
    rich would read "[/b]" in a folder name as markup (and fail on it). Its text is shown, never
    acted on: a control character (an escape sequence in a heartbeat's host, a record's error)
    is printed as its escape (basics/user_files.py `printable`), in lines and table cells alike
    (rich makes both through `render_str`)."""

    def render_str(self, text: str, **kwargs):  # type: ignore[override]
        return super().render_str(printable(text), **kwargs)


def plain_console(**options) -> Console:
    return PlainConsole(markup=False, highlight=False, **options)


def say_error(message: str) -> None:
    """`error: ...` on stderr, one line whatever the message holds (a file's text, a path),
    with no control character a terminal would act on."""
    typer.echo(f"error: {printable(message, one_line=True)}", err=True)


WRAPPED = ("prompt", "error", "problems", "defaults", "resolves to", "offloaded")


def print_tables(console: Console, *tables: Table) -> None:
    for table in tables:
        for column in table.columns:
            if str(column.header) in WRAPPED:
                column.overflow = "fold"
            else:
                cells = [column.header, *column.cells]
                column.no_wrap = True
                column.min_width = max(console.measure(c).maximum for c in cells)
        need = Measurement.get(console, console.options.update(max_width=10**6), table).minimum
        if need > console.width:
            print_stacked(console, table)
        else:
            console.print(table)


def print_stacked(console: Console, table: Table) -> None:
    """`table`'s rows one under the other: the first cell, then `header: value` lines, indented."""
    columns = [(str(c.header), list(c.cells)) for c in table.columns]
    if not columns:
        return
    (first, cells), *rest = columns
    for r in range(len(cells)):
        lines = [f"{first} {_plain(cells[r])}".strip()]
        lines += [f"  {header}: {_plain(cells_[r])}" for header, cells_ in rest if _plain(cells_[r])]
        for line in lines:
            console.print(line, highlight=False, markup=False)


def _plain(cell) -> str:
    """A table cell's text (a string, or rich Text)."""
    return getattr(cell, "plain", None) or str(cell or "")
