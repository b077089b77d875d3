"""Attention kernels that return the attention state (out, lse), converted once here
into the canonical float32 layout of runtime/state.py, and the choice among them (--attention).

Shape legend: B batch, S query tokens, K key tokens, H heads, D head dim.

Backends:
- `sdpa`: PyTorch's fused kernels: on CPU `_scaled_dot_product_flash_attention_for_cpu`
  (lse [B, H, S]); on CUDA the flash kernel for fp16/bf16 and the memory-efficient kernel
  for fp32 (its lse is padded along S to a multiple of 32 and is sliced back);
- `flash`: flash-attn 2's `flash_attn_func` (CUDA, fp16/bf16; optional dependency), lse [B, H, S];
- `flash3`: FlashAttention-3, flash-attention's hopper/ build (module `flash_attn_interface`;
  Hopper GPUs, fp16/bf16), lse [B, H, S]; its return convention changed twice (`_flash3_call`);
- `reference`: float64 math, for tests and debugging.
`auto` is flash3 on a Hopper GPU (compute capability 9.x) where it imports, else flash where
flash-attn imports (fp16/bf16), else sdpa.

With one rank a branch (strategy none) no processor of ours is installed: diffusers' own
attention runs the chosen kernel through its attention dispatch (`use_on_one_rank`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Literal

import torch

from basics.errors import ConfigError
from runtime.profiling import region
from runtime.state import AttentionState

Backend = Literal["sdpa", "flash", "flash3", "reference"]
BACKENDS = ("auto", "sdpa", "flash", "flash3", "reference")
OLD_NAMES = {"torch": "sdpa"}  # a run file's or report's --attention-backend value before the rename
# diffusers' AttentionBackendName (models/attention_dispatch.py) for the kernels one rank runs
DIFFUSERS_NAMES = {"sdpa": "native", "flash": "flash", "flash3": "_flash_3"}
HALF = (torch.float16, torch.bfloat16)


def _loads(module: str, what: str) -> bool:
    """Whether `module` imports. A broken build (compiled for another torch or CUDA) fails with
    other errors than ImportError (OSError for a missing symbol or library, RuntimeError): those
    fall back to another kernel with a warning, once, instead of ending the run."""
    try:
        __import__(module)
    except ImportError:
        return False
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warnings.warn(
            f"{what} is installed but does not load ({type(exc).__name__}: {first}); using another attention "
            f"kernel (reinstall {what} for this torch and CUDA to use it)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


@functools.cache
def flash_attn_available() -> bool:
    """Whether flash-attn 2 imports (a broken build warns once: `_loads`)."""
    return _loads("flash_attn", "flash-attn")


@functools.cache
def flash3_available() -> bool:
    """Whether FlashAttention-3 imports (module `flash_attn_interface`; a broken build warns once)."""
    return _loads("flash_attn_interface", "FlashAttention-3 (flash_attn_interface)")


def _capability(device: torch.device) -> tuple[int, int] | None:
    """`device`'s CUDA compute capability; None where this process sees no GPU (a launcher for
    GPUs elsewhere, a torch built without CUDA)."""
    try:
        return tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else None  # type: ignore[return-value]
    except (AssertionError, RuntimeError):
        return None


def resolve_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    check_installed: bool = True,
    one_rank: bool = False,
    masked: bool = False,
) -> Backend:
    """The kernel `--attention name` runs on `device`, or a one-line ConfigError where it cannot.
    `dtype`: the transformer's compute dtype (flash-attn has fp16/bf16 kernels only).
    `check_installed` False: for ranks elsewhere (a Slurm job), whose GPU and packages this
    machine cannot tell; they resolve `auto` again for themselves. `one_rank`: strategy none,
    where diffusers' attention dispatch runs the kernel (`use_on_one_rank`) and must find it too;
    `masked`: there, the model hands its attention a mask (`passes_attention_mask`)."""
    name = OLD_NAMES.get(name, name)
    if name not in BACKENDS:
        raise ConfigError(f"--attention must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        fast = ("flash3", "flash")
        return next((b for b in fast if _why_not(b, device, dtype, True, one_rank, masked) is None), "sdpa")  # type: ignore[return-value]
    if name == "reference" and one_rank:
        raise ConfigError(
            "--attention reference is for a parallel strategy's own attention (float64 states to merge); "
            "one rank runs diffusers' attention: use sdpa, flash or flash3"
        )
    if problem := _why_not(name, device, dtype, check_installed, one_rank, masked):
        raise ConfigError(f"--attention {name} {problem}")
    return name  # type: ignore[return-value]


def _why_not(
    name: str, device: torch.device, dtype: torch.dtype, check_installed: bool, one_rank: bool, masked: bool = False
) -> str | None:
    """Why kernel `name` cannot run here, said after "--attention NAME"; None: it can."""
    if name in ("sdpa", "reference"):
        return None
    if one_rank and masked:  # diffusers: "`attn_mask` is not supported for flash-attn 2" (and 3)
        return (
            "on one rank runs in diffusers' attention, whose flash-attn backends take no attention mask, "
            "and this model passes one (its text padding); use sdpa, or a parallel strategy"
        )
    if device.type != "cuda":
        return "needs CUDA; use sdpa (or auto) on CPU"
    if dtype not in HALF:
        return "needs --dtype bfloat16 or float16; use sdpa for float32"
    if not check_installed:
        return None
    if name == "flash3":
        capability = _capability(device)
        if capability is None or capability[0] != 9:
            seen = "no GPU here" if capability is None else f"this GPU is {capability[0]}.{capability[1]}"
            return f"needs a Hopper GPU (compute capability 9.x), {seen}; use flash, sdpa or auto"
        if not flash3_available():
            return (
                "needs FlashAttention-3, which is not installed or does not load "
                "(module flash_attn_interface: build flash-attention's hopper/ folder)"
            )
    elif not flash_attn_available():
        return "needs flash-attn, which is not installed or does not load (pip install 'ditango[flash]')"
    return _diffusers_refusal(name) if one_rank else None


def _diffusers_refusal(name: str) -> str | None:
    """Why diffusers' attention dispatch cannot run `name` though it imports here: it takes
    flash-attn from 2.6.3 on, FlashAttention-3 only where the package `flash_attn_3` is found,
    and it passes `return_attn_probs`, which FlashAttention-3 takes from 2025-08-29 on."""
    from diffusers.models import attention_dispatch

    if name == "flash" and not getattr(attention_dispatch, "_CAN_USE_FLASH_ATTN", False):
        return "on one rank runs in diffusers' attention, which needs flash-attn >= 2.6.3; use sdpa"
    if name == "flash3":
        import flash_attn_interface

        if not getattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", False):
            return "on one rank runs in diffusers' attention, which finds no package flash_attn_3; use flash or sdpa"
        if not _takes(flash_attn_interface.flash_attn_func, "return_attn_probs"):
            return (
                "on one rank runs in diffusers' attention, which needs a FlashAttention-3 build from 2025-08-29 on "
                "(flash_attn_func(return_attn_probs=...)); update it, or use flash or sdpa"
            )
    return None


def passes_attention_mask(family: str) -> bool:
    """Whether the family's diffusers transformer hands its attention a mask (a forward that
    takes `encoder_attention_mask`, the text's padding), which diffusers' flash-attn backends refuse."""
    from runtime.models.families import FAMILIES, find_class

    return _takes(find_class(FAMILIES[family].TRANSFORMER_CLASS).forward, "encoder_attention_mask")


def use_on_one_rank(transformers: Iterable[torch.nn.Module], backend: Backend) -> None:
    """Have diffusers' own attention processors (one rank a branch: none of ours installed) run
    `backend`, through diffusers' attention dispatch (`ModelMixin.set_attention_backend`).
    `resolve_backend(..., one_rank=True)` has checked that it can."""
    name = DIFFUSERS_NAMES[backend]
    chatty = logging.getLogger("diffusers.models.modeling_utils")  # "an experimental feature", every call
    level = chatty.level
    chatty.setLevel(logging.ERROR)
    try:
        for transformer in transformers:
            if hasattr(transformer, "set_attention_backend"):
                transformer.set_attention_backend(name)
    finally:
        chatty.setLevel(level)


def _takes(func: Callable, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@functools.cache
def _flash3_call(module) -> Callable:
    """`call(q_BSHD, k_BKHD, v_BKHD, softmax_scale=)` -> (out_BSHD, lse_BHS, ...) for this
    FlashAttention-3 build. Its hopper/flash_attn_interface.py `flash_attn_func` returned, over
    its history (github.com/Dao-AILab/flash-attention):
    - (out, softmax_lse), always: from the first release (2024-07, 7f67966c) to 2025-05;
    - out only, the lse out of reach: from 2025-07-11 ("[FA3] Don't return lse", ed209409);
    - out, or (out, softmax_lse) with return_attn_probs=True: from 2025-08-29 (#1851, 203b9b3d).
    softmax_lse is [B, H, S] float32 in every one. Builds without the flag, from the refactor
    of 2025-01 (7a802796) on, have `_flash_attn_forward(q, k, v, k_new, ...)` returning
    (out, softmax_lse, *rest): the middle ones are called through it."""
    func = module.flash_attn_func
    if _takes(func, "return_attn_probs"):
        return functools.partial(func, return_attn_probs=True)
    forward = getattr(module, "_flash_attn_forward", None)
    if forward is not None and _takes(forward, "k_new"):
        own = ("q", "k", "v", "softmax_scale", "causal")
        empty = inspect.Parameter.empty
        unused = {
            n: None for n, p in inspect.signature(forward).parameters.items() if p.default is empty and n not in own
        }
        return functools.partial(forward, causal=False, **unused)
    return func


def reference_attention(q_BSHD, k_BKHD, v_BKHD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_BSHD, lse_BSH) in float64: the ground truth the tests compare against."""
    q, k, v = (t.double() for t in (q_BSHD, k_BKHD, v_BKHD))
    scores_BHSK = torch.einsum("bshd,bkhd->bhsk", q, k) * scale
    lse_BHS = torch.logsumexp(scores_BHSK, dim=-1)
    probs = torch.exp(scores_BHSK - lse_BHS.unsqueeze(-1))
    out_BSHD = torch.einsum("bhsk,bkhd->bshd", probs, v)
    return out_BSHD, lse_BHS.transpose(1, 2)


def _sdpa_kernel(q_BSHD, k_BKHD, v_BKHD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))  # -> B H S D
    if q.device.type == "cpu":
        out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    elif q.dtype in HALF:
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


def _flash3_kernel(q_BSHD, k_BKHD, v_BKHD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_BSHD in q's dtype, lse_BSH float32) from FlashAttention-3, whichever convention its
    build returns in (`_flash3_call`)."""
    import flash_attn_interface

    result = _flash3_call(flash_attn_interface)(q_BSHD, k_BKHD, v_BKHD, softmax_scale=scale)
    if isinstance(result, torch.Tensor):
        raise RuntimeError(
            "this FlashAttention-3 build returns no softmax_lse; update it (builds from 2025-08-29 on take "
            "return_attn_probs), or use --attention flash or sdpa"
        )
    out_BSHD, lse_BHS = result[0], result[1]
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
        elif backend == "flash3":
            out, lse = _flash3_kernel(q_BSHD, k_BKHD, v_BKHD, scale)
        else:
            out, lse = _sdpa_kernel(q_BSHD, k_BKHD, v_BKHD, scale)
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
        if backend == "flash3":
            from flash_attn_interface import flash_attn_func

            result = flash_attn_func(q_BSHD, k_BKHD, v_BKHD, softmax_scale=scale)
            return result if isinstance(result, torch.Tensor) else result[0]  # builds before 2025-07: (out, lse)
        q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))  # -> B H S D
        if q.device.type == "cpu":  # the kernel `attention` runs: the same output
            out_BHSD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[0]
        else:  # PyTorch picks its fastest kernel for the GPU
            out_BHSD = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return out_BHSD.transpose(1, 2)
