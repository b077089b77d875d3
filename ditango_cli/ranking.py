"""`ditango simulate --batch` and `--objective`: the layout search's ranking (planner/search.py)
for N videos of one size, or for a prompt file's items, each priced at the size, frames, steps
and guidance `generate --prompts` would give it (runtime/items.py reads the file)."""

from __future__ import annotations

import json
from collections import Counter

from rich.table import Table

from basics.errors import ConfigError
from basics.user_files import digits, printable, user_path
from ditango_cli.tables import plain_console, print_tables

TOP = 10  # ranking rows shown (--json: all)


def batch_items(text: str, defaults, given) -> tuple[int, tuple]:
    """--batch N: (N, ()); --batch FILE: (its item count, its items), read as `generate --prompts
    FILE` reads it, with `given` (runtime/items.py Overrides: simulate's --height, --width,
    --frames, --steps and --guidance) where a line leaves a value out, else the model's
    `defaults`. A bad file is one line (a ConfigError)."""
    from runtime.items import build_items

    count = digits(text)
    if count is not None:
        return count, ()  # refused below 1 by the search's Problem, as before
    path = user_path(text, "--batch")
    if not path.exists():  # anything else there: the reader says what it is
        raise ConfigError(
            f"--batch {printable(text, one_line=True)}: give a number of videos (>= 1) or a prompt file "
            "(.txt or .jsonl, as generate --prompts reads); no such file"
        )
    try:
        items = build_items(None, path, given, defaults)
    except ConfigError as exc:  # the reader names the option it serves: here that is --batch
        message = str(exc)
        raise ConfigError(
            "--batch " + message.removeprefix("--prompts ") if message.startswith("--prompts ") else message
        ) from None
    return len(items), items


def mix_of(items) -> tuple:
    """The search's `mix`: each item's (size, steps, CFG scale)."""
    return tuple((it.size, it.steps, it.cfg_scale) for it in items)


def mix_json(p) -> list[dict]:
    """The batch's distinct items and how many of each, first seen first."""
    counts = Counter(p.mix)
    return [
        {"height": s.height, "width": s.width, "frames": s.frames, "steps": n, "guidance": g, "videos": counts[s, n, g]}
        for s, n, g in p.kinds()
    ]


def print_ranking(hw, p, model: str, as_json: bool, prompts: str | None = None) -> int:
    """The layout search's ranking: a table of the best, and why the first wins. `prompts`: the
    file the batch's items came from (its makespans on the shared queue, longest first, and
    split round-robin are shown beside each layout)."""
    from planner.cost_model import report_dict
    from planner.search import search, seconds, why

    choices, notes = search(hw, p)
    if not choices:
        raise ConfigError(f"no layout of {model} fits {p.nodes} x {p.gpus_per_node} GPUs: " + "; ".join(notes))
    reason = why(choices, p)
    if as_json:
        mixed = {"prompts": prompts, "mix": mix_json(p)} if p.mix else {}
        data = {"schema": 1, "objective": p.objective, "batch": p.count, **mixed, "why": reason, "notes": notes}
        data["assumptions"] = {
            **report_dict(hw),
            "model": model,
            "steps": p.steps,
            "height": p.size.height,
            "width": p.size.width,
            "frames": p.size.frames,
        }
        print(json.dumps({**data, "ranking": [c.to_json() for c in choices]}, indent=2))
        return 0
    console = plain_console()
    size = f"{p.size.width}x{p.size.height}x{p.size.frames}, {p.steps} steps"
    what = f"{p.count} video(s)"
    if p.mix:
        what = f"{what} from {prompts} ({len(p.kinds())} distinct, the largest {size})"
    console.print(
        f"{model}, {what if p.mix else f'{size}, {what}'} on {p.nodes} x {p.gpus_per_node} {hw.name}; best "
        f"{p.objective} first (modelled; see --json assumptions).",
        highlight=False,
    )
    spans = ["queue, longest first (s)", "round robin (s)"] if p.mix else []
    per = "s/largest video" if p.mix else "s/video"
    table = Table("#", "layout", per, "videos/h", *spans, "peak GiB/GPU", "inter-node GB", "generate flags")
    for i, c in enumerate(choices[:TOP], 1):
        times = [seconds(s).removesuffix(" s") for s in (c.batch_s, c.round_robin_s)] if p.mix else []
        table.add_row(
            str(i),
            c.label,
            seconds(c.e2e_s).removesuffix(" s"),
            f"{c.videos_per_hour:.1f}",
            *times,
            f"{c.peak_memory_bytes / 2**30:.1f}",
            f"{c.inter_node_bytes / 1e9:.1f}",
            " ".join(c.flags()) or "-",
        )
    print_tables(console, table)
    console.print(f"why: {reason}")
    for note in notes:
        console.print(f"note: {note}")
    return 0
