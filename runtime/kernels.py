"""Attention kernels that return the attention state (out, lse), converted once here
into the canonical float32 layout of runtime/state.py.

Shape legend: B batch, S query tokens, K key tokens, H heads, D head dim.

Backends:
- `flash`: flash-attn's `flash_attn_func` (CUDA only; optional dependency), lse [B, H, S];
- `torch`: PyTorch's fused kernels: on CPU `_scaled_dot_product_flash_attention_for_cpu`
  (lse [B, H, S]); on CUDA the flash kernel for fp16/bf16 and the memory-efficient kernel
  for fp32 (its lse is padded along S to a multiple of 32 and is sliced back);
- `reference`: float64 math, for tests and debugging.
`auto` is `flash` on CUDA when flash-attn imports, else `torch`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import torch

from basics.errors import ConfigError
from runtime.profiling import region
from runtime.state import AttentionState

Backend = Literal["flash", "torch", "reference"]
BACKENDS = ("auto", "flash", "torch", "reference")


@functools.cache
def flash_attn_available() -> bool:
    """Whether flash-attn imports. A broken build (compiled for another torch or CUDA) fails
    with other errors than ImportError (OSError for a missing symbol or library, RuntimeError):
    those fall back to the torch backend with a warning, once, instead of ending the run."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warnings.warn(
            f"flash-attn is installed but does not load ({type(exc).__name__}: {first}); using the torch attention "
            "backend (reinstall flash-attn for this torch and CUDA to use it)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def resolve_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, check_installed: bool = True
) -> Backend:
    """`dtype`: the transformer's compute dtype (flash-attn has fp16/bf16 kernels only).
    `check_installed` False: for ranks elsewhere (a Slurm job), whose flash-attn this machine
    cannot tell; they resolve `auto` again for themselves."""
    if name not in BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        return "flash" if device.type == "cuda" and half and flash_attn_available() else "torch"
    if name == "flash":
        if device.type != "cuda":
            raise ConfigError("--attention-backend flash needs CUDA; use torch (or auto) on CPU")
        if not half:
            raise ConfigError("--attention-backend flash needs --dtype bfloat16 or float16; use torch for float32")
        if check_installed and not flash_attn_available():
            raise ConfigError(
                "--attention-backend flash: flash-attn is not installed or does not load (pip install 'ditango[flash]')"
            )
    return name  # type: ignore[return-value]


def reference_attention(q_BSHD, k_BKHD, v_BKHD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_BSHD, lse_BSH) in float64: the ground truth the tests compare against."""
    q, k, v = (t.double() for t in (q_BSHD, k_BKHD, v_BKHD))
    scores_BHSK = torch.einsum("bshd,bkhd->bhsk", q, k) * scale
    lse_BHS = torch.logsumexp(scores_BHSK, dim=-1)
    probs = torch.exp(scores_BHSK - lse_BHS.unsqueeze(-1))
    out_BSHD = torch.einsum("bhsk,bkhd->bshd", probs, v)
    return out_BSHD, lse_BHS.transpose(1, 2)


def _torch_kernel(q_BSHD, k_BKHD, v_BKHD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))  # -> B H S D
    if q.device.type == "cpu":
        out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    elif q.dtype in (torch.float16, torch.bfloat16):
        out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[
            :2
        ]
    else:
        out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale
        )[:2]
        lse_BHS = lse_BHS[..., : q.shape[2]]
    return out_BHSD.transpose(1, 2), lse_BHS.transpose(1, 2)


def _flash_kernel(q_BSHD, k_BKHD, v_BKHD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn import flash_attn_func

    out_BSHD, lse_BHS, _ = flash_attn_func(q_BSHD, k_BKHD, v_BKHD, softmax_scale=scale, return_attn_probs=True)
    return out_BSHD, lse_BHS.transpose(1, 2)


def attention(
    q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, scale: float, backend: Backend
) -> AttentionState:
    """Softmax attention of the queries over one KV partition, as a float32 state."""
    with region("attention"):
        if backend == "reference":
            out, lse = reference_attention(q_BSHD, k_BKHD, v_BKHD, scale)
        elif backend == "flash":
            out, lse = _flash_kernel(q_BSHD, k_BKHD, v_BKHD, scale)
        else:
            out, lse = _torch_kernel(q_BSHD, k_BKHD, v_BKHD, scale)
    return AttentionState.from_kernel(out, lse)


def attention_output(
    q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, scale: float, backend: Backend
) -> torch.Tensor:
    """Softmax attention over the whole KV in one call: the output only [B, S, H, D], in q's
    dtype. Where nothing is merged (one rank, or Ulysses without a ring) the state's float32
    copy and lse would be made only to be dropped."""
    with region("attention"):
        if backend == "reference":
            return reference_attention(q_BSHD, k_BKHD, v_BKHD, scale)[0].to(q_BSHD.dtype)
        if backend == "flash":
            from flash_attn import flash_attn_func

            return flash_attn_func(q_BSHD, k_BKHD, v_BKHD, softmax_scale=scale)
        q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))  # -> B H S D
        if q.device.type == "cpu":  # the kernel `attention` runs: the same output
            out_BHSD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[0]
        else:  # PyTorch picks its fastest kernel for the GPU
            out_BHSD = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return out_BHSD.transpose(1, 2)
