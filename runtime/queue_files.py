"""The file operations the batch queue (runtime/batch_queue.py) is made of, each atomic on the
shared file systems clusters use (NFS, Lustre, GPFS, BeeGFS): a file created with its whole
content or not at all (a hard link of a complete file, which fails when the name exists; an
O_EXCL create where there are no hard links), a rename, a folder fsynced after it changed so
that another host sees the new name, and a file's mtime set by the file server (`touch`,
utime without times). No lock (flock is not coherent across hosts on most of them).

Ages are taken by the folder's own clock (`fs_clock`): a host whose clock is off does not
take a live lease for a stale one."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import read_text
from runtime.errors import OutputWriteError

READ_LIMIT = 2**20  # a queue file is a few hundred bytes; a larger one is not ours


def fsync_folder(folder: Path) -> None:
    """Make a folder's new or renamed entries durable, and visible to other hosts' lookups."""
    with contextlib.suppress(OSError):  # some file systems refuse to open a folder for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_folder(path: Path) -> Path:
    """`path` made (with its parents) if missing; an OutputWriteError when the disk refuses."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    return path


def create_exclusive(path: Path, data: dict) -> bool:
    """Create `path` holding `data` (JSON) in one step, unless it exists: True when this call made
    it. Nobody ever reads it half written. The temporary file is fsynced first, so the link
    never names an empty file after a crash. A file system that refuses the write (full, read
    only) is an OutputWriteError naming the file."""
    try:
        return _create_exclusive(path, data)
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None


def _create_exclusive(path: Path, data: dict) -> bool:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    text = json.dumps(data, ensure_ascii=False, allow_nan=False) + "\n"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: an exclusive create instead
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        fsync_folder(path.parent)
        return True
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def replace_json(path: Path, data: dict) -> None:
    """Write `path` whole, atomically (a temporary file renamed over it): for files one writer
    owns (a worker's own status), never for a decision between writers."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(json.dumps(data, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_json_file(path: Path) -> dict | None:
    """A queue file's JSON object, None when it is missing, being replaced, or not ours (not a
    regular file, too large, not JSON, not an object): read bounded, never blocking on a FIFO."""
    try:
        data = json.loads(read_text(path, "queue file", READ_LIMIT))
    except (OSError, ValueError, RecursionError, ConfigError):
        return None
    return data if isinstance(data, dict) else None


def fs_now(folder: Path) -> float:
    """Now by the file server's clock (the one mtimes are set by): the mtime of a file touched;
    this host's clock where the file cannot be made (a full disk: ages are only read then)."""
    stamp = folder / ".clock"
    try:
        stamp.touch()
        return stamp.stat().st_mtime
    except OSError:
        return time.time()


def touch(path: Path) -> bool:
    """Renew `path`'s mtime to the server's now; False when it is gone."""
    try:
        os.utime(path)
        return True
    except OSError:
        return False


def numbered(folder: Path) -> list[int]:
    """The numbers that name the files of `folder` ("1", "2", ...), in order."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and len(n) < 10)
