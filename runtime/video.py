"""Atomic output writing: MP4 (H.264, and AAC audio when a model makes sound, through
imageio-ffmpeg's ffmpeg), latents, JSON, PNG.

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
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
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
AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)  # Hz
_AUDIO_STREAM = re.compile(r"^\s*Stream #0:\d+\S*: Audio: (\w+)", re.MULTILINE)  # "... Audio: aac (LC) ..."


@dataclass(frozen=True, eq=False)  # eq=False: arrays do not compare to one bool
class Audio:
    """A soundtrack, e.g. LTX-2's. rate in Hz; samples as below, nominally in [-1, 1]
    (write_mp4 clips)."""

    samples: np.ndarray  # float32 [channels, samples]; channels 1 (mono) or 2 (stereo)
    rate: int

    def __post_init__(self) -> None:
        s = self.samples
        if not (isinstance(s, np.ndarray) and s.dtype == np.float32 and s.ndim == 2 and s.shape[0] in (1, 2)):
            got = f"{s.dtype} {list(s.shape)}" if isinstance(s, np.ndarray) else type(s).__name__
            raise ValueError(f"audio samples must be float32 [channels 1 or 2, samples], got {got}")
        if s.shape[1] == 0 or not (isinstance(self.rate, (int, np.integer)) and self.rate > 0):
            raise ValueError(f"audio needs samples and a positive integer rate in Hz, got {s.shape[1]} at {self.rate}")

    @property
    def seconds(self) -> float:
        return self.samples.shape[1] / self.rate

    def __repr__(self) -> str:
        return f"Audio(samples={list(self.samples.shape)}, rate={self.rate})"


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


def write_mp4(path: Path, frames_FHWC: np.ndarray, fps: int, audio: Audio | None = None) -> None:
    """frames_FHWC: uint8 [F, H, W, 3]. H.264, yuv420p (plays everywhere); with `audio`, an AAC
    stream too (samples clipped to [-1, 1]), muxed in the same ffmpeg run. The video stream is
    the same bytes with or without it; neither stream is cut to the other's length.

    ffmpeg (imageio-ffmpeg's binary) is run here rather than through imageio's writer, which
    does not look at ffmpeg's exit status: a trailer that could not be written (a full disk)
    left an MP4 that does not decode, committed under its final name."""
    assert frames_FHWC.dtype == np.uint8 and frames_FHWC.ndim == 4 and frames_FHWC.shape[-1] == 3
    frames, height, width = frames_FHWC.shape[:3]
    if audio is not None and audio.rate not in AAC_RATES:
        # ffmpeg would resample, and a short clip resampled to no samples leaves no audio track.
        raise ValueError(f"AAC has no {audio.rate} Hz: resample the audio to one of {', '.join(map(str, AAC_RATES))}")

    def encode(tmp: Path) -> None:
        video_in = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps), "-i", "pipe:0"]
        codecs = ["-c:v", "libx264", "-pix_fmt", "yuv420p"]  # x264's default quality (crf 23)
        # The samples go through a partial file beside the video (stdin carries the frames); a
        # writer killed here leaves it to remove_partials like the video's own partial file.
        pcm = tmp.with_suffix(".f32")
        if audio is None:
            audio_args = ["-an"]
        else:
            audio_in = ["-f", "f32le", "-ar", str(audio.rate), "-ac", str(audio.samples.shape[0])]
            audio_args = [*audio_in, "-i", f"file:{pcm.resolve()}", "-map", "0:v", "-map", "1:a"]
            codecs += ["-c:a", "aac", "-b:a", "128k"]
        cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-y", "-v", "error", *video_in, *audio_args, *codecs]
        cmd.append(f"file:{tmp.resolve()}")  # file: so that no name reads as an option or a protocol
        raw = memoryview(np.ascontiguousarray(frames_FHWC)).cast("B")
        try:
            if audio is not None:  # interleaved [samples, channels], as ffmpeg's raw f32le input reads them
                pcm.write_bytes(np.clip(np.nan_to_num(audio.samples), -1, 1).T.astype("<f4").tobytes())
            done = subprocess.run(cmd, input=raw, capture_output=True)
        finally:  # also when the samples met a full disk
            pcm.unlink(missing_ok=True)
        if done.returncode != 0:
            raise OSError(f"ffmpeg exited with status {done.returncode}{_ffmpeg_cause(done.stderr)}")
        if tmp.stat().st_size == 0:
            raise OSError(f"ffmpeg wrote nothing for {frames} frames")

    _atomic(path, encode)


def _ffmpeg_cause(stderr: bytes) -> str:
    """': <first line>' of what ffmpeg said, or ''. Its first line is the cause ("Error writing
    trailer: No space left on device"); the rest are consequences. Without the
    "[out#0/mp4 @ 0x...] " of its source."""
    said = [_FFMPEG_SOURCE.sub("", ln).strip() for ln in stderr.decode("utf-8", "replace").splitlines()]
    said = [ln for ln in said if ln]
    return f": {said[0]}" if said else ""


def write_latents(
    path: Path, latents: torch.Tensor, metadata: dict[str, str], audio_latents: torch.Tensor | None = None
) -> None:
    """The final latents ("latents"), and a model's audio latents ("audio_latents") with them."""
    tensors = {"latents": latents} if audio_latents is None else {"latents": latents, "audio_latents": audio_latents}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}

    def save(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
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


def read_audio(path: Path) -> Audio | None:
    """The MP4's first audio stream, decoded; None when it has none. Used by tests."""
    decoded = _decode_audio(path)
    return None if decoded is None else decoded[1]


def audio_info(path: Path) -> dict | None:
    """{"codec", "rate" (Hz), "channels", "seconds"} of the MP4's audio stream; None without one."""
    decoded = _decode_audio(path)
    if decoded is None:
        return None
    codec, audio = decoded
    return {"codec": codec, "rate": int(audio.rate), "channels": audio.samples.shape[0], "seconds": audio.seconds}


def _decode_audio(path: Path) -> tuple[str, Audio] | None:
    """(codec name, the first audio stream decoded); None when the file has none.

    There is no ffprobe: ffmpeg run with no output lists the streams (and fails for want of an
    output), then decodes to Sun AU on a pipe, whose 24-byte header states the rate and channel
    count. ffmpeg drops the AAC encoder's priming and padding (the MP4's edit list), so the
    count of samples is the one written."""
    ffmpeg, source = imageio_ffmpeg.get_ffmpeg_exe(), f"file:{Path(path).resolve()}"
    listed = subprocess.run([ffmpeg, "-nostdin", "-hide_banner", "-i", source], capture_output=True)
    said = listed.stderr.decode("utf-8", "replace")
    if "Input #0" not in said:  # it did not open; the last line says why, earlier ones may be warnings
        raise OSError(f"cannot read {path}: {(said.strip().splitlines() or ['ffmpeg could not open it'])[-1]}")
    codec = _AUDIO_STREAM.search(said)
    if codec is None:
        return None
    cmd = [ffmpeg, "-nostdin", "-v", "error", "-i", source, "-map", "0:a:0", "-c:a", "pcm_f32be", "-f", "au", "pipe:1"]
    done = subprocess.run(cmd, capture_output=True)
    if done.returncode != 0:
        raise OSError(
            f"cannot decode the audio of {path}: ffmpeg exited with {done.returncode}{_ffmpeg_cause(done.stderr)}"
        )
    magic, offset, _, encoding, rate, channels = struct.unpack(">4s5I", done.stdout[:24])
    assert magic == b".snd" and encoding == 6, "ffmpeg's AU output is not float32"  # 6: 32-bit IEEE float
    samples = np.frombuffer(done.stdout[offset:], ">f4").astype(np.float32)
    return codec.group(1), Audio(np.ascontiguousarray(samples.reshape(-1, channels).T), rate)
