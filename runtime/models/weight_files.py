"""Weight files, a model folder's or a LoRA's: safetensors by their content, whatever their name.

A pickle (what `torch.save` writes, and the `.bin`, `.pt`, `.ckpt` files of older
checkpoints) can run code when it is read. A file is taken as weights only when its bytes are
a safetensors file (a header length, then that many bytes of JSON naming each tensor's dtype,
shape and place), as safetensors' own reader finds them; that reader never unpickles. The
name is never trusted: `x.safetensors` that is a `torch.save` file, or a symbolic link to one,
is refused as the file itself would be. A link is followed for the bytes only: the name a
loader is handed stays the link's, so a Hugging Face cache snapshot (links into `blobs/`,
whose files have no extension) loads as the folder a user sees.
"""

from __future__ import annotations

from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import require_regular_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# How pickles begin: a protocol 2+ pickle's PROTO opcode, or the zip archive torch.save writes.
PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")


def pickle_inside(path: Path) -> bool:
    """Whether `path`'s first bytes are a pickle's or torch.save's archive (read, never loaded)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(PICKLE_MAGIC)


def tensor_shapes(path: Path, what: str, error: type[ConfigError] = ConfigError) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the safetensors file at `path` (a link is followed), read from its
    header only; `error` (a one-line ConfigError) when it is no regular file or not safetensors
    by its content: a pickle under any name is named as one, and never read further."""
    try:
        require_regular_file(path, what)
    except ConfigError as exc:
        raise error(str(exc)) from None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file") from None
    except Exception as exc:  # safetensors' own error types for a header that is not one
        if pickle_inside(path):
            raise error(
                f"{what} {path} is a pickle (torch.save) file, whatever its name: pickle files are never loaded "
                "(convert it with safetensors.torch.save_file)"
            ) from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise error(f"{what} {path} is not a safetensors file ({first})") from None
