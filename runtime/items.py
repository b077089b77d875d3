"""Prompt sources -> validated Items.

`--prompt TEXT` gives one item; `--prompts FILE` gives a batch:
- `.txt`: one prompt per line; blank lines and lines starting with `#` are skipped;
- `.jsonl`: one JSON object per line with `prompt` and optionally `id`,
  `negative_prompt`, `seed`, `height`, `width`, `frames`, `steps`, `guidance`;
  a line's values override the command line.
Item ids are the given `id`, or `<index>-<hash of prompt and seed>`: short,
filesystem-safe, and never the raw prompt text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from planner.errors import ConfigError
from runtime.config import Item
from runtime.models.registry import Defaults

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
RESERVED_IDS = {"report"}  # report.json lives beside the items
INT_KEYS = ("seed", "height", "width", "frames", "steps")
JSONL_KEYS = {"id", "prompt", "negative_prompt", "guidance", *INT_KEYS}


@dataclass(frozen=True)
class Overrides:
    """Command-line values; None means "the model's default"."""

    negative_prompt: str | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None


def derived_id(index: int, prompt: str, seed: int) -> str:
    digest = hashlib.sha1(f"{prompt}\0{seed}".encode()).hexdigest()[:8]
    return f"{index:04d}-{digest}"


def _check_id(value: object, where: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value) or value in RESERVED_IDS:
        raise ConfigError(
            f"{where}: id {value!r} is not a usable file name; use 1-100 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit (and not 'report')"
        )
    return value


def make_item(fields: dict, index: int, source: str, cli: Overrides, defaults: Defaults) -> Item:
    def pick(key: str, cli_value, default):
        value = fields.get(key)
        if value is not None:
            return value
        return default if cli_value is None else cli_value

    prompt = fields["prompt"]
    seed = pick("seed", cli.seed, 0)
    item_id = _check_id(fields["id"], source) if "id" in fields else derived_id(index, prompt, seed)
    return Item(
        id=item_id,
        prompt=prompt,
        negative_prompt=pick("negative_prompt", cli.negative_prompt, defaults.negative_prompt),
        seed=seed,
        height=pick("height", cli.height, defaults.height),
        width=pick("width", cli.width, defaults.width),
        frames=pick("frames", cli.frames, defaults.frames),
        steps=pick("steps", cli.steps, defaults.steps),
        guidance=float(pick("guidance", cli.guidance, defaults.guidance)),
        vae_stride=defaults.vae_stride,
        patch=defaults.patch,
        index=index,
        source=source,
    )


def _jsonl_fields(line: str, where: str) -> dict:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f'{where}: expected a JSON object like {{"prompt": "..."}}')
    unknown = sorted(set(data) - JSONL_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(JSONL_KEYS))}")
    if not isinstance(data.get("prompt"), str):
        raise ConfigError(f'{where}: "prompt" is required and must be a string')
    for key in ("negative_prompt",):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f'{where}: "{key}" must be a string')
    for key in INT_KEYS:
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int)):
            raise ConfigError(f'{where}: "{key}" must be an integer, got {data[key]!r}')
    if "guidance" in data and (isinstance(data["guidance"], bool) or not isinstance(data["guidance"], (int, float))):
        raise ConfigError(f'{where}: "guidance" must be a number, got {data["guidance"]!r}')
    return data


def read_prompt_file(path: Path) -> list[tuple[dict, str]]:
    """[(fields, "FILE line N")] for every item line of a .txt or .jsonl file."""
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ConfigError(f"--prompts {path}: expected a .txt or .jsonl file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate a byte-order mark
    except FileNotFoundError:
        raise ConfigError(f"--prompts {path}: file not found") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--prompts {path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"--prompts {path}: cannot read ({exc.strerror})") from None
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{path.name} line {number}"
        if suffix == ".txt":
            if line and not line.startswith("#"):
                entries.append(({"prompt": line}, where))
        elif line:
            entries.append((_jsonl_fields(line, where), where))
    if not entries:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return entries


def build_items(prompt: str | None, prompts_file: Path | None, cli: Overrides, defaults: Defaults) -> tuple[Item, ...]:
    if prompt is not None and prompts_file is not None:
        raise ConfigError("give either --prompt or --prompts, not both")
    if prompt is None and prompts_file is None:
        raise ConfigError("nothing to generate: give --prompt TEXT or --prompts FILE")
    if prompt is not None:
        entries = [({"prompt": prompt}, "--prompt")]
    else:
        entries = read_prompt_file(prompts_file)
    return tuple(make_item(fields, i, where, cli, defaults) for i, (fields, where) in enumerate(entries))
