"""Whether a run can write in an output folder, checked before anything is loaded: OUT (or the
nearest folder on the way to it) takes a file, it is not on a kernel's pseudo file system, the
tool's bookkeeping there is of the kind it writes (no FIFO where its lock goes, no link for its
clock), and no item's file exists as something else. Each is one line and exit 2, never a
failure after the video is made."""

from __future__ import annotations

import re
import stat
import tempfile
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import user_path
from runtime.config import RunConfig
from runtime.outputs import STATE_DIR, output_paths

# What the tool keeps in an output folder, each a folder or a regular file where it exists:
# its state (the lock, jobs.json of slurm/jobs.py, launch.json of slurm/launchers/env.py, the clock,
# progress files, task and replica reports, the env launcher's rank errors, the batch's queue), the logs of its
# submissions, and the run report.
FOLDERS = (STATE_DIR, f"{STATE_DIR}/progress", f"{STATE_DIR}/reports", f"{STATE_DIR}/ranks", f"{STATE_DIR}/queue",
           "logs")  # fmt: skip
FILES = (f"{STATE_DIR}/lock", f"{STATE_DIR}/jobs.json", f"{STATE_DIR}/launch.json", f"{STATE_DIR}/clock",
         "report.json", "report.html")  # fmt: skip


def check_bookkeeping(out_dir: Path) -> None:
    """A one-line ConfigError when an entry of FOLDERS or FILES exists in `out_dir` as something
    else (`.ditango` a file, its lock a FIFO, whose read would wait for a writer for ever), or
    as a symbolic link to nothing or in a loop (the lock could never be made, nor taken over), or
    when a file of FILES is a link (the folder's clock would be touched wherever it points):
    before a run writes there (`status` and `report` only read, and set such an entry aside)."""
    for names, want, is_kind in ((FOLDERS, "a folder", stat.S_ISDIR), (FILES, "a regular file", stat.S_ISREG)):
        for name in names:
            path = out_dir / name
            try:
                link = stat.S_ISLNK(path.lstat().st_mode)
            except OSError:  # not there: made where needed
                continue
            try:
                mode = path.stat().st_mode
            except OSError:
                mode = None
            if link and (mode is None or names is FILES):
                what = "a symbolic link" + (" to nothing, or in a loop" if mode is None else "")
                raise ConfigError(
                    f"{path} is {what}, not {want}: ditango keeps its bookkeeping there; move it away, "
                    "or use another --out"
                )
            if not is_kind(mode):
                raise ConfigError(
                    f"{out_dir / name} is {_kind(mode)}, not {want}: ditango keeps its bookkeeping "
                    "there; move it away, or use another --out"
                )


def check_item_files(cfg: RunConfig) -> None:
    """A one-line ConfigError, before anything runs, when a file an item would be written to
    exists as something else (a folder named like its MP4 or sidecar): the run would make the
    video, then fail to write it."""
    for item in cfg.items:
        for path in output_paths(cfg.out_dir, item.id).values():
            try:
                mode = path.stat().st_mode
            except OSError:  # not there, or a link to nothing (the writer's rename replaces it)
                continue
            if not stat.S_ISREG(mode):
                raise ConfigError(
                    f"{item.source}: {path} is {_kind(mode)}, not a regular file, and item {item.id} is "
                    "written there; move it away, or use another --out"
                )


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    )
    return next((name for test, name in kinds if test(mode)), "a device")


# Kernel interfaces mounted as file systems: they hold no regular files, whatever the
# permission bits say (root may "write" under /proc by os.access).
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devpts",
        "debugfs",
        "tracefs",
        "securityfs",
        "configfs",
        "bpf",
        "pstore",
        "efivarfs",
        "fusectl",
        "mqueue",
        "binfmt_misc",
        "autofs",
        "nsfs",
    }
)


def check_writable(out: Path, create: bool) -> None:
    """Fail early (before loading anything) when outputs could not be written: by creating (and
    removing) a file, in OUT (`create`, made first) or, without creating OUT (`ditango check`),
    in the nearest folder on the way to it that exists. Both ways give the same message."""
    out = user_path(out, "--out")
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"output dir {out} is a symbolic link to nothing (a loop, or a target that is gone)")
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"output dir {out} is not writable: {probe} is not a directory")
    if probe == out:
        check_bookkeeping(out)
    kind = _filesystem_type(probe)
    if kind in PSEUDO_FILESYSTEMS:
        raise ConfigError(f"output dir {out} is not writable: {probe} is on {kind}, a file system that holds no files")
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out if create else probe, prefix=".ditango-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"output dir {out} is not writable: {exc.strerror or exc}") from None


def _filesystem_type(path: Path) -> str | None:
    """The type of the file system `path` is on, from /proc/self/mountinfo (the mount point that
    is the longest prefix of the resolved path; the last of stacked mounts); None off Linux."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = "", None
    for line in lines:
        left, sep, right = line.partition(" - ")  # "<id> <parent> <dev> <root> <mount point> ... - <type> ..."
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # spaces come as \040
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return kind
