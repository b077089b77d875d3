"""Values a rehearsal knows without data (runtime/rehearse/): a tensor made by a fill (zeros,
ones, full) holds one value in every element, and keeps it through casts, copies, views,
negation, comparison with a scalar and reductions; a write into its storage forgets it.

What this answers: the size of a boolean selection (`x[mask]`, `nonzero`), which on fake
tensors has no size (torch raises DynamicOutputShapeException) and on a GPU waits for it.
A mask with a known value selects every element or none; a mask of unknown values selects
every element (as a read of a bool answers True: the text masks count every token valid),
and from then on its negation selects none. HunyuanVideo-1.5's forward is the case:
diffusers puts the valid text tokens first by boolean indexing with the text masks (unknown:
all valid) and the image mask (zeros for text-to-video: none valid).
"""

from __future__ import annotations

import operator
import weakref

import torch

aten = torch.ops.aten
FILLS = {aten.zeros: 0, aten.zeros_like: 0, aten.new_zeros: 0, aten.ones: 1, aten.ones_like: 1, aten.new_ones: 1}
FILL_ARG = {aten.full: 1, aten.full_like: 1, aten.new_full: 2}  # the fill value's position
# Ops whose outputs hold their first argument's elements (any number of them, cast to their dtype)
SAME = {aten._to_copy, aten.clone, aten.detach, aten.alias, aten.lift_fresh, aten.view, aten._unsafe_view,
        aten.reshape, aten.expand, aten.select, aten.slice, aten.narrow, aten.unbind, aten.split,
        aten.split_with_sizes, aten.unsqueeze, aten.squeeze, aten.permute, aten.t, aten.transpose, aten.repeat,
        aten.flatten, aten.index, aten.amax, aten.amin}  # fmt: skip
COMPARE = {aten.eq: operator.eq, aten.ne: operator.ne, aten.lt: operator.lt, aten.le: operator.le,
           aten.gt: operator.gt, aten.ge: operator.ge}  # fmt: skip
NEGATE = {aten.bitwise_not, aten.logical_not}
REDUCE = {aten.all, aten.any}
RULED = {*FILLS, *FILL_ARG, *SAME, *COMPARE, *NEGATE, *REDUCE, aten.cat}
MASK_DTYPES = (torch.bool, torch.uint8)


def _cast(value, dtype: torch.dtype):
    if dtype == torch.bool:
        return bool(value)
    return float(value) if dtype.is_floating_point else int(value)


def _storage(t: torch.Tensor) -> int:
    """Which storage `t` views (a wrapper subclass, DTensor, has none to ask: itself)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


class Known:
    """The tensors whose every element holds one known value (by weak reference: a tensor freed
    is forgotten); `after` follows each dispatched op."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref, object]] = {}  # id(tensor) -> (its ref, value)
        self._storages: dict[int, set[int]] = {}  # a storage -> the ids of the known tensors on it
        self._ops: dict = {}  # op -> (what it writes, the rule its output follows or None)
        self._purge_at = 1024

    def get(self, t: torch.Tensor):
        """The value every element of `t` holds, or None."""
        entry = self._values.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def assume(self, t: torch.Tensor, value) -> None:
        if len(self._values) >= self._purge_at:  # drop the freed ones now and then
            self._values = {k: e for k, e in self._values.items() if e[0]() is not None}
            self._storages = {s: ids & self._values.keys() for s, ids in self._storages.items()}
            self._storages = {s: ids for s, ids in self._storages.items() if ids}
            self._purge_at = max(1024, 2 * len(self._values))
        self._values[id(t)] = (weakref.ref(t), _cast(value, t.dtype))
        self._storages.setdefault(_storage(t), set()).add(id(t))

    def selected(self, mask: torch.Tensor) -> bool:
        """Whether boolean `mask` selects every element (True) or none; unknown: every one,
        remembered so its negation selects none."""
        value = self.get(mask)
        if value is None:
            self.assume(mask, True)
            return True
        return bool(value)

    def selection(self, mask: torch.Tensor) -> list[torch.Tensor]:
        """The integer indices equal to boolean indexing by `mask` (one int64 tensor per mask
        dimension, its selected coordinates in row-major order, as `nonzero` lists them)."""
        if not self.selected(mask) or not mask.numel():
            return [torch.empty(0, dtype=torch.long, device=mask.device) for _ in mask.shape]
        flat = torch.arange(mask.numel(), device=mask.device)
        coords, stride = [], mask.numel()
        for size in mask.shape:
            stride //= size
            coords.append(flat // stride % size)
        return coords

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        """Follow `func(*args, **kwargs) -> out`: forget what it wrote, learn what it made."""
        op = self._ops.get(func)
        if op is None:
            op = self._ops[func] = _op(func)
        writes, packet = op
        if writes and self._values:
            for t in _written(writes, args, kwargs):
                self._forget(t)
        if packet is None:
            return
        value = None
        first = args[0] if args else None
        if packet in FILLS:
            value = FILLS[packet]
        elif packet in FILL_ARG:
            value = args[FILL_ARG[packet]] if len(args) > FILL_ARG[packet] else kwargs.get("fill_value")
        elif packet is aten.fill_ or packet is aten.zero_:  # the whole written tensor, after the forgetting
            value = 0 if packet is aten.zero_ else args[1]
            value = self.get(value) if isinstance(value, torch.Tensor) else value
            if value is not None:
                self.assume(first, value)
            return
        elif packet is aten.cat:  # one value in every non-empty part
            parts = {self.get(t) if t.numel() else "empty" for t in args[0]} - {"empty"}
            if len(parts) == 1 and None not in parts:
                value = parts.pop()
        elif isinstance(first, torch.Tensor) and (known := self.get(first)) is not None:
            if packet in SAME:
                value = known
            elif packet in NEGATE:
                value = (not known) if packet is aten.logical_not or first.dtype == torch.bool else ~int(known)
            elif packet in COMPARE and len(args) > 1:
                other = args[1] if not isinstance(args[1], torch.Tensor) else self.get(args[1])
                value = None if other is None else COMPARE[packet](known, other)
            elif packet in REDUCE:
                value = bool(known) if first.numel() else packet is aten.all
        if value is None or isinstance(value, torch.Tensor):
            return
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.assume(t, value)

    def _forget(self, t: torch.Tensor) -> None:
        """Forget `t` and every tensor sharing its storage (its views and base)."""
        for key in self._storages.pop(_storage(t), ()):
            self._values.pop(key, None)


def _op(func) -> tuple:
    """(what `func` writes: "all" its tensors for a collective (c10d's schemas do not mark the
    buffers they fill), else its schema's written arguments as (position, name); the packet
    whose rule its output follows, or None)."""
    if func.namespace in ("c10d", "_c10d_functional"):
        writes = "all"
    else:
        writes = [(i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write]
    packet = func.overloadpacket
    ruled = packet in RULED or packet is aten.fill_ or packet is aten.zero_
    return writes, packet if ruled else None


def _written(writes, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if writes == "all":
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    else:
        leaves = [
            t
            for i, name in writes
            for t in torch.utils._pytree.tree_leaves(args[i] if i < len(args) else kwargs.get(name))
        ]
    return [t for t in leaves if isinstance(t, torch.Tensor)]
