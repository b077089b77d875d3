"""Atomic output writing: MP4 (H.264 through imageio-ffmpeg's ffmpeg), latents, JSON, PNG.

Every file is written under a temporary name in the destination folder, flushed to the disk
and renamed into place, so neither an interrupted run nor a full disk ever leaves a truncated
file under a final name; a write that fails is an OutputWriteError naming the file. The
temporary names (`.<name>.partial-<pid><suffix>`) start with a dot, which no item id does:
the next run that owns the folder removes any a killed writer left (runtime/lock.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import imageio.v2 as imageio
import imageio.v3 as iio
import imageio_ffmpeg
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from runtime.errors import OutputWriteError

PARTIAL_GLOB = ".*.partial-*"
_FFMPEG_SOURCE = re.compile(r"^\[[^\]]* @ 0x[0-9a-f]+\] ")


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)`, then flush `tmp` to the disk and give it its final name. A failure (a full
    disk, a read-only or vanished folder) leaves nothing under `path` and raises
    OutputWriteError naming the file. The fsync is where a file system that writes back late
    (NFS, a quota) reports what the writes did not."""
    tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")  # the real suffix last
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_mp4(path: Path, frames_FHWC: np.ndarray, fps: int) -> None:
    """frames_FHWC: uint8 [F, H, W, 3]. H.264, yuv420p (plays everywhere).

    ffmpeg (imageio-ffmpeg's binary) is run here rather than through imageio's writer, which
    does not look at ffmpeg's exit status: a trailer that could not be written (a full disk)
    left an MP4 that does not decode, committed under its final name."""
    assert frames_FHWC.dtype == np.uint8 and frames_FHWC.ndim == 4 and frames_FHWC.shape[-1] == 3
    frames, height, width = frames_FHWC.shape[:3]

    def encode(tmp: Path) -> None:
        cmd = [
            imageio_ffmpeg.get_ffmpeg_exe(),
            "-nostdin",
            "-y",
            "-v",
            "error",
            "-f",
            "rawvideo",
            "-pix_fmt",
            "rgb24",
            "-s",
            f"{width}x{height}",
            "-r",
            str(fps),
            "-i",
            "pipe:0",
            "-an",
            "-c:v",
            "libx264",
            "-pix_fmt",
            "yuv420p",  # x264's default quality (crf 23)
            f"file:{tmp.resolve()}",  # file: so that no name reads as an option or a protocol
        ]
        raw = memoryview(np.ascontiguousarray(frames_FHWC)).cast("B")
        done = subprocess.run(cmd, input=raw, capture_output=True)
        if done.returncode != 0:
            # Its first word is the cause ("Error writing trailer: No space left on device"); the
            # rest are consequences. Without the "[out#0/mp4 @ 0x...] " of its source.
            said = [_FFMPEG_SOURCE.sub("", ln).strip() for ln in done.stderr.decode("utf-8", "replace").splitlines()]
            said = [ln for ln in said if ln]
            raise OSError(f"ffmpeg exited with status {done.returncode}" + (f": {said[0]}" if said else ""))
        if tmp.stat().st_size == 0:
            raise OSError(f"ffmpeg wrote nothing for {frames} frames")

    _atomic(path, encode)


def write_latents(path: Path, latents: torch.Tensor, metadata: dict[str, str]) -> None:
    tensor = latents.detach().to("cpu").contiguous()

    def save(tmp: Path) -> None:
        try:
            save_file({"latents": tensor}, str(tmp), metadata=metadata)
        except SafetensorError as exc:  # its I/O errors ("No space left on device") are not OSErrors
            raise OSError(str(exc).removeprefix("Error while serializing: ")) from None

    _atomic(path, save)


def write_json(path: Path, data: dict) -> None:
    # allow_nan=False: NaN/Infinity are not JSON; fail here rather than write a file parsers reject.
    text = json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    _atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    _atomic(path, lambda tmp: tmp.write_bytes(data))


def write_png(path: Path, rgb_HWC: np.ndarray) -> None:
    write_bytes(path, iio.imwrite("<bytes>", rgb_HWC, extension=".png"))  # a failed write to a file warns twice


def read_mp4(path: Path) -> np.ndarray:
    """uint8 [F, H, W, 3]; used by tests and quality tools."""
    return np.stack(list(imageio.mimread(path, format="FFMPEG", memtest=False)))
