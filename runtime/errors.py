"""Errors of the runtime a user can fix (see basics/errors.py for ConfigError itself)."""

from basics.errors import ConfigError


class ModelDirError(ConfigError):
    """A model directory is missing, partial, or holds weights we refuse to load."""


class OutputWriteError(RuntimeError):
    """An output (video, latents, sidecar, report) could not be written: a full disk, a
    read-only or vanished folder. Not retried: the next attempt would meet the same disk; the
    run stops, keeping what it finished, and the same command resumes once it is fixed."""

    @classmethod
    def of(cls, path, exc: OSError) -> "OutputWriteError":
        return cls(f"cannot write {path}: {exc.strerror or exc}")


# What a rank says when a PEER failed (not the root cause): blame prefers any other error.
PEER_FAILURE_MARKERS = (
    "FailedJobError", "UncompletedJobError", "Connection closed by peer", "Connection reset by peer", "Read error",
    "remote worker", "gloo/transport", "Timed out waiting", "NCCL communicator was aborted", "ProcessGroup",
)  # fmt: skip


def is_peer_failure(message: str) -> bool:
    return any(m in message for m in PEER_FAILURE_MARKERS)
