"""MP4s that carry a model's soundtrack (LTX-2 makes video with audio): write_mp4 muxes an AAC
stream beside the unchanged H.264 one, and audio_info / read_audio read it back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest

from runtime.errors import OutputWriteError
from runtime.video import PARTIAL_GLOB, Audio, audio_info, read_audio, read_mp4, write_mp4

RATE = 24000  # Hz
SECONDS = 0.4
FPS = 16
AAC_SLACK_S = 2 * 1024 / RATE  # one AAC frame of padding plus the encoder's 1024-sample priming
HZ_TOL = 3.0  # the FFT bins of a 0.4 s clip are 2.5 Hz apart
LEFT_HZ, RIGHT_HZ = 440.0, 660.0


def frames() -> np.ndarray:
    """uint8 [9, 64, 64, 3] of noise: every bit of the picture matters to the encoder."""
    return np.random.default_rng(0).integers(0, 255, (9, 64, 64, 3), dtype=np.uint8)


def tone(channels: int, amplitude: float = 0.5) -> Audio:
    """0.4 s of sine: 440 Hz on the first channel, 660 Hz on the second (a swapped or mixed
    pair of channels shows)."""
    t = np.arange(round(SECONDS * RATE)) / RATE
    hz = [LEFT_HZ, RIGHT_HZ][:channels]
    return Audio((amplitude * np.sin(2 * np.pi * np.array(hz)[:, None] * t)).astype(np.float32), RATE)


def dominant_hz(samples_T: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples_T * np.hanning(len(samples_T))))
    return float(np.fft.rfftfreq(len(samples_T), 1 / rate)[np.argmax(spectrum)])


def h264_stream(path: Path) -> bytes:
    """The MP4's video stream as an Annex B H.264 bitstream (copied, not decoded)."""
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-v", "error", "-i", f"file:{path}"]
    return subprocess.run(
        [*cmd, "-map", "0:v", "-c", "copy", "-f", "h264", "pipe:1"], capture_output=True, check=True
    ).stdout


@pytest.mark.parametrize("channels", [1, 2], ids=["mono", "stereo"])
def test_the_mp4_carries_the_tone_as_aac(tmp_path, channels):
    audio = tone(channels)
    write_mp4(tmp_path / "v.mp4", frames(), FPS, audio)

    info = audio_info(tmp_path / "v.mp4")
    assert info is not None, "no audio stream in the MP4"
    assert (info["codec"], info["rate"], info["channels"]) == ("aac", RATE, channels)
    assert abs(info["seconds"] - SECONDS) <= AAC_SLACK_S, info

    decoded = read_audio(tmp_path / "v.mp4")
    assert decoded.samples.shape[0] == channels
    for c, hz in enumerate([LEFT_HZ, RIGHT_HZ][:channels]):
        wave = decoded.samples[c]
        assert abs(dominant_hz(wave, decoded.rate) - hz) <= HZ_TOL, f"channel {c}"
        rms = float(np.sqrt(np.mean(wave**2)))
        assert 0.8 * 0.5 / np.sqrt(2) < rms < 1.2 * 0.5 / np.sqrt(2), f"channel {c}: rms {rms} of a 0.5 sine"


def test_the_video_is_the_same_with_or_without_audio(tmp_path):
    write_mp4(tmp_path / "silent.mp4", frames(), FPS)
    write_mp4(tmp_path / "sound.mp4", frames(), FPS, tone(2))
    assert audio_info(tmp_path / "silent.mp4") is None
    assert read_audio(tmp_path / "silent.mp4") is None
    assert np.array_equal(read_mp4(tmp_path / "sound.mp4"), read_mp4(tmp_path / "silent.mp4"))
    assert h264_stream(tmp_path / "sound.mp4") == h264_stream(tmp_path / "silent.mp4")


def test_samples_beyond_full_scale_are_clipped(tmp_path):
    """A sine of amplitude 3 is clipped to [-1, 1] before AAC (which would carry 3 through)."""
    write_mp4(tmp_path / "v.mp4", frames(), FPS, tone(1, amplitude=3.0))
    wave = read_audio(tmp_path / "v.mp4").samples[0]
    assert 0.9 < np.abs(wave).max() < 1.3  # a clipped sine is near-square: AAC rings a little
    assert abs(dominant_hz(wave, RATE) - LEFT_HZ) <= HZ_TOL


def test_a_failing_ffmpeg_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: "/bin/false")
    with pytest.raises(OutputWriteError, match=r"^cannot write .*v\.mp4: ffmpeg exited with status 1$"):
        write_mp4(tmp_path / "v.mp4", frames(), FPS, tone(2))
    assert list(tmp_path.iterdir()) == []  # neither the video nor the samples' partial file
    assert not list(tmp_path.glob(PARTIAL_GLOB))


def test_bad_audio_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="float32"):
        Audio(np.zeros((1, 100), np.int16), RATE)
    with pytest.raises(ValueError, match="channels 1 or 2"):
        Audio(np.zeros((6, 100), np.float32), RATE)
    with pytest.raises(ValueError, match="positive integer rate"):
        Audio(np.zeros((1, 100), np.float32), 0)
    with pytest.raises(ValueError, match="AAC has no 12345 Hz.*24000"):
        write_mp4(tmp_path / "v.mp4", frames(), FPS, Audio(np.zeros((1, 100), np.float32), 12345))
    assert list(tmp_path.iterdir()) == []
    assert tone(2).seconds == pytest.approx(SECONDS)


@pytest.mark.parametrize("free_pages", [2, 24], ids=["no-room-for-the-samples", "no-room-for-the-mp4"])
def test_a_full_disk_leaves_neither_file(tmp_path, free_pages):
    """The samples' partial file goes too, whether it or the MP4 met the full disk."""
    from tests.test_full_disk import PAGE, small_disk

    with small_disk(tmp_path, free_pages * PAGE) as disk:
        with pytest.raises(OutputWriteError, match=r"^cannot write .*v\.mp4: .*No space left on device$"):
            write_mp4(disk / "v.mp4", frames(), FPS, tone(2))
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
