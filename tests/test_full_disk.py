"""Outputs on a disk that fills up, or on a read-only folder: nothing half-written keeps a final
name, a failed item is never counted done, every failure is one line, and the same command
resumes once there is room. On small tmpfs mounts (root; in CI they must work, elsewhere the
tests skip without the permission)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ditango_cli.app import app
from runtime.errors import OutputWriteError
from runtime.video import read_mp4, write_mp4
from slurm.supervise import STOPPED

PAGE = 4096
TINY = ["--prompt", "a red ball", "--steps", "1", "--height", "32", "--width", "32", "--frames", "5",
        "--device", "cpu", "--quiet", "--retries", "2"]  # fmt: skip


def _mount(target: Path, *options: str) -> bool:
    done = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True)
    if done.returncode != 0 and os.environ.get("CI"):
        pytest.fail(f"mount {' '.join(options)} failed in CI: {done.stderr.strip()}")
    return done.returncode == 0


@contextlib.contextmanager
def small_disk(tmp_path: Path, free_bytes: int):
    """A 1 MiB tmpfs with `free_bytes` left (the rest taken by a filler file)."""
    disk = tmp_path / f"disk-{free_bytes}"
    disk.mkdir()
    if not _mount(disk, "-t", "tmpfs", "-o", "size=1m", "tmpfs"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        stat = os.statvfs(disk)
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - free_bytes))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def decodes(path: Path) -> bool:
    try:
        return len(read_mp4(path)) > 0
    except Exception:  # noqa: BLE001 - any failure to read it back means it is broken
        return False


def test_an_encoder_that_fails_leaves_no_file_and_names_the_reason(tmp_path):
    """Bug: imageio's writer ignored ffmpeg's exit status, so an MP4 whose trailer could not be
    written (an 8 KB file that does not decode) was committed under its final name."""
    frames = np.random.default_rng(0).integers(0, 255, (9, 64, 64, 3), dtype=np.uint8)
    with small_disk(tmp_path, 2 * PAGE) as disk:
        with pytest.raises(OutputWriteError, match=r"cannot write .*v\.mp4: ffmpeg exited .*No space left on device"):
            write_mp4(disk / "v.mp4", frames, 16)
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no final name, no partial file
    write_mp4(tmp_path / "v.mp4", frames, 16)
    assert read_mp4(tmp_path / "v.mp4").shape == frames.shape


@pytest.mark.parametrize("kind", ["latents", "json", "png"])
def test_every_writer_fails_as_one_error_naming_its_file(tmp_path, kind):
    """Bug: safetensors' I/O errors are no OSErrors (they went unrecognised), and imageio's PNG
    writer warned twice from a destructor after the failed write."""
    import torch

    from runtime.video import write_json, write_latents, write_png

    big = np.random.default_rng(1).integers(0, 255, (256, 256, 3), dtype=np.uint8)
    write = {
        "latents": lambda p: write_latents(p, torch.zeros(100_000), {"id": "x"}),
        "json": lambda p: write_json(p, {"values": list(range(20_000))}),
        "png": lambda p: write_png(p, big),
    }[kind]
    with small_disk(tmp_path, PAGE) as disk:
        target = disk / f"out.{kind}"
        with pytest.raises(OutputWriteError, match=rf"^cannot write {target}: .*No space left on device"):
            write(target)
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


@pytest.mark.e2e
def test_a_disk_that_fills_up_at_any_point_never_counts_a_broken_item_done(runner, tmp_path):
    """A sweep of the free space around what one item writes (video, sidecar, report, lock):
    bug: 6 of 8 free-space points ended in a traceback raised while recording the failure, and
    a truncated MP4 stayed under its final name with the item later counted done."""
    reference = tmp_path / "reference"
    assert runner.invoke(app, ["generate", *TINY, "--out", str(reference)]).exit_code == 0
    # + 4 pages: the bookkeeping's own files, and the output path the JSON files record is longer on
    # the small disk than the reference's (a report near a page boundary takes one more there).
    needed = sum(-(-p.stat().st_size // PAGE) for p in reference.rglob("*") if p.is_file()) + 4
    outcomes = set()
    for free in range(0, needed + 1):
        with small_disk(tmp_path, free * PAGE) as disk:
            out = disk / "run"
            result = runner.invoke(app, ["generate", *TINY, "--out", str(out)])
            assert "Traceback" not in result.output, (free, result.output)
            assert result.exception is None or isinstance(result.exception, SystemExit), (free, result.exception)
            lines = result.stderr.strip().splitlines()
            videos = list(out.glob("*.mp4")) if out.is_dir() else []
            assert all(decodes(v) for v in videos), (free, videos)  # nothing broken keeps a final name
            assert not list(out.glob(".*.partial-*")) if out.is_dir() else True
            if result.exit_code == 0:
                assert len(videos) == 1 and json.loads(next(out.glob("0000-*.json")).read_text())["status"] == "done"
                outcomes.add("done")
                continue
            assert result.exit_code in (1, 2) and lines and all(ln.startswith("error: ") for ln in lines), (free, lines)
            assert any("No space left on device" in ln for ln in lines), (free, lines)
            if lines[0].startswith("error: 0000-"):  # the item's own failure, recorded or not, never retried
                assert "retry" not in lines[0] and lines[0].endswith(STOPPED), (free, lines)
                outcomes.add("item failed")
            # Room again: the report never counts the failed item done, and the same command resumes.
            (disk / "filler").unlink()
            if (out / ".ditango").is_dir():
                shown = runner.invoke(app, ["report", str(out), "--json"])
                assert shown.exit_code == 0, (free, shown.output)
                done = [i for i in json.loads((out / "report.json").read_text())["items"] if i["status"] == "done"]
                assert all(decodes(out / i["video"]) for i in done), (free, done)
            again = runner.invoke(app, ["generate", *TINY, "--out", str(out)])
            assert again.exit_code == 0, (free, again.stderr)
            assert len(list(out.glob("*.mp4"))) == 1 and all(decodes(v) for v in out.glob("*.mp4"))
    # The sweep crossed a failure inside the item and enough room.
    assert outcomes == {"done", "item failed"}, outcomes


def test_a_read_only_output_folder(runner, tmp_path):
    """Bug: `ditango report` on a read-only folder gave an EROFS traceback."""
    out = tmp_path / "out"
    assert runner.invoke(app, ["generate", *TINY, "--out", str(out)]).exit_code == 0
    view = tmp_path / "view"
    view.mkdir()
    if not _mount(view, "--bind", str(out)):
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        assert _mount(view, "-o", "remount,bind,ro")
        shown = runner.invoke(app, ["report", str(view)])
        assert shown.exit_code == 1 and "1 done" in shown.stdout
        assert shown.stderr.strip() == f"error: cannot write {view / 'report.json'}: Read-only file system"
        again = runner.invoke(app, ["generate", *TINY, "--out", str(view)])
        assert again.exit_code == 2
        assert again.stderr.strip() == f"error: output dir {view} is not writable: Read-only file system"
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)
