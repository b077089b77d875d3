"""Atomic output writing: MP4 (H.264 through imageio-ffmpeg), latents, JSON.

Every file is written under a temporary name in the destination folder and renamed
into place, so an interrupted run never leaves a truncated file under a final name. The
temporary names (`.<name>.partial-<pid><suffix>`) start with a dot, which no item id does:
the next run that owns the folder removes any a killed writer left (runtime/lock.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import torch
from safetensors.torch import save_file

PARTIAL_GLOB = ".*.partial-*"


def _partial(path: Path) -> Path:
    # Keep the real suffix last: ffmpeg picks the container from it.
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")


def _commit(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)


def write_mp4(path: Path, frames_FHWC: np.ndarray, fps: int) -> None:
    """frames_FHWC: uint8 [F, H, W, 3]. H.264, yuv420p (plays everywhere)."""
    assert frames_FHWC.dtype == np.uint8 and frames_FHWC.ndim == 4 and frames_FHWC.shape[-1] == 3
    tmp = _partial(path)
    try:
        writer = imageio.get_writer(
            tmp, format="FFMPEG", mode="I", fps=fps, codec="libx264", pixelformat="yuv420p",
            macro_block_size=1, ffmpeg_log_level="error",
        )  # fmt: skip
        with writer:
            for frame in frames_FHWC:
                writer.append_data(frame)
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_latents(path: Path, latents: torch.Tensor, metadata: dict[str, str]) -> None:
    tmp = _partial(path)
    try:
        save_file({"latents": latents.detach().to("cpu").contiguous()}, str(tmp), metadata=metadata)
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    tmp = _partial(path)
    try:
        # allow_nan=False: NaN/Infinity are not JSON; fail here rather than write a file parsers reject.
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_png(path: Path, rgb_HWC: np.ndarray) -> None:
    tmp = _partial(path)
    try:
        imageio.imwrite(tmp, rgb_HWC)
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_mp4(path: Path) -> np.ndarray:
    """uint8 [F, H, W, 3]; used by tests and quality tools."""
    return np.stack(list(imageio.mimread(path, format="FFMPEG", memtest=False)))
