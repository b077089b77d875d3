"""Files a user names (prompt files, run files, images, magcache ratios): what is refused before
any of them is read."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

from basics.errors import ConfigError


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


def user_path(text: str | Path, what: str, resolve: bool = False) -> Path:
    """A path a user gave, with a leading `~` or `~user` expanded as a shell would (`resolve`:
    absolute, its links followed); `Unreadable` (one line) when that user is unknown or has no
    home (Path.expanduser's RuntimeError), when it holds a NUL byte (no file system takes
    one: a ValueError in every call on it), or when its links loop."""
    if "\0" in str(text):
        raise Unreadable(f"{what} {str(text)!r}", "a path holds no NUL byte")
    try:
        path = Path(text).expanduser()
    except RuntimeError:
        head = str(text).split("/", 1)[0]
        raise Unreadable(f"{what} {text}", f"{head} names no user with a home folder here") from None
    try:
        return path.resolve() if resolve else path
    except (RuntimeError, OSError) as exc:  # Python 3.11 raises RuntimeError on a loop of links
        raise Unreadable(f"{what} {text}", f"its symbolic links loop ({exc})") from None


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
        size = f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit // 2**10} KiB"
        raise Unreadable(f"{what} {path}", f"larger than {size}; not read")
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


# What a terminal acts on instead of showing: C0 controls but tab and newline (ESC starts the
# sequences that set a window's title, clear the screen, move the cursor), DEL, C1 controls
# (0x9b is a one-byte CSI), and the bidirectional overrides that reorder text as it is shown.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_LINE_BREAKS = re.compile("[\n\t]")


def printable(text: str, one_line: bool = False) -> str:
    """`text` as a terminal shows it without acting on it: each control character as its escape
    (ESC as \\x1b); `one_line`: newlines and tabs too. For anything printed that a file or a
    user gave (heartbeats, records, error messages, prompts)."""
    shown = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 256 else f"\\u{ord(m[0]):04x}", text)
    return _LINE_BREAKS.sub(lambda m: "\\n" if m[0] == "\n" else "\\t", shown) if one_line else shown


def digits(text: str | None) -> int | None:
    """The whole number `text` spells in ASCII digits (spaces around it allowed), else None.
    `str.isdigit()` is no test of that: it passes '²' and other digits `int()` refuses."""
    text = (text or "").strip()
    return int(text) if text.isascii() and text.isdigit() else None


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
