"""Memory sizes: what a user writes (8GiB, 500MB) as bytes."""

from __future__ import annotations

from planner.errors import ConfigError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str, flag: str = "size") -> int:
    """'8GiB', '500MB', '1048576' -> bytes; ConfigError naming `flag` for anything else."""
    number = text.strip().upper()
    suffix = number.lstrip("0123456789.")
    value = number[: len(number) - len(suffix)]
    try:
        return int(float(value) * UNITS[suffix.strip()])
    except (KeyError, ValueError):
        raise ConfigError(f"{flag} {text!r}: expected a size like 8GiB, 500MB or 1048576") from None
