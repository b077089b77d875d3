"""Files a user names (prompt files, run files, images, magcache ratios): what is refused before
any of them is read."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from planner.errors import ConfigError


def require_regular_file(path: Path, what: str) -> None:
    """A one-line ConfigError when `path` exists but is no regular file: reading a FIFO waits for
    a writer that may never come, and a device may never end. A missing or unreadable file is
    left to the reader, which says so."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kind = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket"}
    named = next((name for test, name in kind.items() if test(mode)), "a device")
    raise ConfigError(f"{what} {path} is {named}, not a regular file")


# How much of a file a reader takes (a bound, so that /dev/zero or an endless file is one line,
# not a MemoryError): prompt files and reports can be long; configs and run files are small.
TEXT_LIMIT = 256 * 2**20
CONFIG_LIMIT = 16 * 2**20


class Unreadable(ConfigError):
    """A file or text that cannot be read as asked: "{where}: {reason}", one line."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.reason = reason


def read_text(path: Path, what: str, limit: int = CONFIG_LIMIT, encoding: str = "utf-8") -> str:
    """The text of a file a user named (or a model folder holds), as a one-line ConfigError when
    it is no regular file, longer than `limit` bytes, not text in `encoding`, or unreadable.
    FileNotFoundError passes through: each reader says what a missing file means."""
    require_regular_file(path, what)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable(f"{what} {path}", f"cannot read it ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise Unreadable(f"{what} {path}", f"larger than {limit // 2**20} MiB; not read")
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise Unreadable(f"{what} {path}", f"not UTF-8 text (byte {exc.start})") from None


def parse_json(text: str, what: str):
    """The JSON value of `text`, or a one-line ConfigError: not JSON, nested too deeply for the
    parser (a hostile `[[[[...]]]]`), or a string holding a lone surrogate (`\\ud800`: no text,
    which no file or terminal can take)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise Unreadable(what, "JSON nested too deeply") from None
    except ValueError as exc:
        msg = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
        raise Unreadable(what, f"not valid JSON ({msg})") from None
    check_text(data, what)
    return data


def check_text(data, what: str) -> None:
    """A one-line ConfigError when a string in `data` (keys included) is no text: a lone
    surrogate, which JSON's \\u escapes can make. Walked without recursion."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                code = ord(value[exc.start])
                raise Unreadable(what, f"a string holds a lone surrogate (\\u{code:04x}), which is no text") from None


def read_json_file(path: Path, what: str, limit: int = CONFIG_LIMIT):
    """`parse_json` of `read_text`: the JSON value of a file, or a one-line ConfigError."""
    return parse_json(read_text(path, what, limit), f"{what} {path}")
