"""Rich progress over items and denoising steps (stderr, so stdout stays parseable), with the
pace and ETAs of the plain log lines (runtime/pace.py) beside the step bar."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from basics.user_files import printable
from runtime.config import Item
from runtime.pace import Pace, pace_text


class RichObserver:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[pace]}", markup=False),
            console=console,
            transient=True,
        )
        self._items = None
        self._steps = None
        self._label = ""
        self.pace = Pace()

    def __enter__(self) -> RichObserver:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def run_started(self, total: int) -> None:
        self.pace.run_started(total)
        if total:
            self._items = self.progress.add_task("items", total=total, pace="")

    def item_started(self, item: Item) -> None:
        if self._steps is not None:
            self.progress.remove_task(self._steps)
        self.pace.item_started(item.id, item.steps)
        self._label = f"  {item.id}"
        self._steps = self.progress.add_task(self._label, total=item.steps, pace="")

    def step_done(self, step: int, steps: int) -> None:
        self.pace.step_done(step, steps)
        if self._steps is not None:
            self.progress.update(self._steps, completed=step, pace=pace_text(self.pace.snapshot()))

    def phase(self, name: str) -> None:
        self.pace.set_phase(name)
        if self._steps is not None:
            self.progress.update(self._steps, description=f"{self._label} ({name})")

    def item_finished(self, record: dict) -> None:
        self.pace.item_finished()
        if self._items is not None:
            self.progress.advance(self._items)
        if record["status"] == "failed":  # Text is not rendered from a str: shown as text here
            self.console.print(Text.assemble(("failed", "red"), printable(f" {record['id']}: {record['error']}")))
        else:
            total = (record.get("timing") or {}).get("total_s", 0.0)
            said = printable(f" {record['id']} -> {record['video']} ({total:.2f} s)")
            self.console.print(Text.assemble(("done", "green"), said))

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)
