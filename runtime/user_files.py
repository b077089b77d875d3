"""Files a user names (prompt files, run files, images, magcache ratios): what is refused before
any of them is read."""

from __future__ import annotations

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
