"""Attention-state cache for DiTango: one slot per (cfg branch, layer, unit).

Shape legend: N branches, L layers, U units (a unit = k adjacent remote groups whose
states are merged into one, see `compose_factor`), B batch, S local query tokens,
H heads, D head dim.

`out` is stored in the cache dtype (float32, or bfloat16 to halve memory); `lse` always
stays float32: merge weights are exp(lse differences), and a bf16 lse (8 mantissa bits)
would turn a log-sum-exp of ~10 into errors of several percent in those weights.
Buffers are allocated once per item, before its first step (`allocate`), and freed after its
last (`reset`).
How large it may be is decided here too: the cache dtype by device, a user's limit checked
before any rank starts, and on a GPU without one the free memory minus a headroom.
"""

from __future__ import annotations

import math

import torch

from basics.errors import ConfigError
from planner import memory
from planner.ditango import PLANNER_CLASSES, DiTangoOptions, unit_offsets
from planner.layout import chunk_sizes
from planner.memory import anchor_bytes as anchor_bytes  # re-exported for the runtime
from runtime.state import AttentionState


# The byte counts are the memory model's (planner/memory.py): what `StateCache.allocate` and
# `SelectiveRuntime.begin_run` allocate is exactly what the pre-flight predicts. Here they take
# a torch dtype, as the runtime holds one.
def slot_bytes(B: int, S: int, H: int, D: int, dtype: torch.dtype) -> int:
    """Bytes of one cached state: out [B, S, H, D] in `dtype` + lse [B, S, H] in float32."""
    return memory.slot_bytes(B, S, H, D, torch.empty((), dtype=dtype).element_size())


def unit_bytes(B: int, S: int, H: int, D: int, dtype: torch.dtype, reference: bool = True) -> int:
    """Per cached unit: its state slot plus (`reference`: the hpdc planner) the compressed local
    reference [B, S, H] float32 kept for the drift estimate."""
    return memory.unit_bytes(B, S, H, D, torch.empty((), dtype=dtype).element_size(), reference)


def compose_factor(
    groups: int, branches: int, layers: int, slot: int, limit_bytes: int | None, fixed_bytes: int = 0
) -> int:
    """k adjacent remote groups per cached unit, the smallest that fits `limit_bytes`.

    `slot`: bytes of one unit for one (branch, layer) (`unit_bytes`); `fixed_bytes`: what the
    cache needs whatever the units (the anchors' references). Composing is exact (states of
    disjoint partitions merge into the state of their union), but a composed unit is computed
    or reused as a whole.
    """
    if limit_bytes is None or groups <= 0:
        return 1
    per_unit = branches * layers * slot
    units = (limit_bytes - fixed_bytes) // per_unit
    if units < 1:
        need = per_unit + fixed_bytes
        raise ConfigError(
            f"a DiTango cache limit of {limit_bytes} bytes cannot hold one cached unit per branch and layer "
            f"({need} bytes for this item); raise --cache-memory-limit to at least {need}, "
            "use --cache-dtype bfloat16, or more ranks"
        )
    return math.ceil(groups / min(units, groups))


class StateCache:
    def __init__(self, branches: int, layers: int, units: int, dtype: torch.dtype) -> None:
        self.shape_NLU = (branches, layers, units)
        self.dtype = dtype
        self.out_NLUBSHD: torch.Tensor | None = None
        self.lse_NLUBSH: torch.Tensor | None = None
        self.filled_NLU = torch.zeros(self.shape_NLU, dtype=torch.bool)
        self.peak_bytes = 0

    def allocate(self, B: int, S: int, H: int, D: int, device: torch.device | str = "cpu") -> None:
        """Every slot at once, at the start of an item: an out-of-memory shows before the first
        step, not halfway through the denoising."""
        self.out_NLUBSHD = torch.empty((*self.shape_NLU, B, S, H, D), dtype=self.dtype, device=device)
        self.lse_NLUBSH = torch.empty((*self.shape_NLU, B, S, H), dtype=torch.float32, device=device)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def put(self, branch: int, layer: int, unit: int, state: AttentionState) -> None:
        if self.out_NLUBSHD is None:
            B, S, H, D = state.out_BSHD.shape
            self.allocate(B, S, H, D, state.out_BSHD.device)
        self.out_NLUBSHD[branch, layer, unit].copy_(state.out_BSHD)
        self.lse_NLUBSH[branch, layer, unit].copy_(state.lse_BSH)
        self.filled_NLU[branch, layer, unit] = True

    def get(self, branch: int, layer: int, unit: int) -> AttentionState:
        assert self.filled_NLU[branch, layer, unit], f"no cached state for {(branch, layer, unit)}"
        return AttentionState(self.out_NLUBSHD[branch, layer, unit].float(), self.lse_NLUBSH[branch, layer, unit])

    def nbytes(self) -> int:
        if self.out_NLUBSHD is None:
            return 0
        return self.out_NLUBSHD.nbytes + self.lse_NLUBSH.nbytes

    def reset(self) -> None:
        self.out_NLUBSHD = self.lse_NLUBSH = None
        self.filled_NLU.zero_()

    def __repr__(self) -> str:
        shape = None if self.out_NLUBSHD is None else tuple(self.out_NLUBSHD.shape)
        return f"StateCache(NLU={self.shape_NLU}, out={shape}, dtype={self.dtype}, bytes={self.nbytes()})"


CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # DiTangoOptions.cache_dtype names
# Without --cache-memory-limit on a GPU, the cache may take the free memory minus this much,
# left for activations, the KV blocks in flight and the allocator's fragmentation.
AUTO_LIMIT_HEADROOM_FRACTION = 0.10  # of the GPU's total memory
AUTO_LIMIT_HEADROOM_MIN = 4 * 2**30


def cache_dtype_for(name: str | None, device: torch.device) -> torch.dtype:
    """`name` None: bfloat16 on CUDA (where memory decides what fits), float32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return CACHE_DTYPES[name]


def check_cache_limit(
    opts: DiTangoOptions, items, layout, heads: int, head_dim: int, layers: int, device: torch.device
) -> None:
    """Raise now (before any rank starts) when a user's cache limit cannot hold one cached unit
    per branch and layer of some item: the same sizing `SelectiveRuntime.begin_run` does."""
    if opts.cache_limit_bytes is None:
        return
    dtype = cache_dtype_for(opts.cache_dtype, device)
    for item in items:
        tokens = max(chunk_sizes(item.tokens(), layout.cp_degree))
        branches = 1 if layout.cfg_degree == 2 or item.cfg_scale <= 1 else 2
        reference = PLANNER_CLASSES[opts.planner.planner].Statistics.reference_states
        per_unit = unit_bytes(1, tokens, heads, head_dim, dtype, reference=reference)
        own = len(unit_offsets(layout.groups, layout.group, opts.planner.own_group)) - (layout.groups - 1)
        fixed = branches * layers * (anchor_bytes(1, tokens, heads) + own * per_unit)
        compose_factor(layout.groups - 1, branches, layers, per_unit, opts.cache_limit_bytes, fixed)


def auto_cache_limit(device: torch.device) -> int | None:
    """This GPU's budget for the cache when the user set none: free memory (counting what the
    allocator holds unused) minus the headroom. None on CPU (no cap)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    headroom = max(AUTO_LIMIT_HEADROOM_MIN, int(AUTO_LIMIT_HEADROOM_FRACTION * total))
    return max(1, free - headroom)
