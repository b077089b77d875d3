"""`--compile`: regional compilation of the transformer's repeated block, and the custom ops
that let a block compile whole under every strategy.

One compiled block serves every layer (diffusers' `compile_repeated_blocks` idea: the block
class is compiled once, each layer's weights are its inputs), so the compile takes seconds.
What a strategy does inside a block (the exchanges of ring and Ulysses, DiTango's cached
states, tensor parallelism's all-reduces and their byte counts) is Python that torch.compile
cannot trace: it runs behind `torch.library.custom_op`s (`ditango::attend`,
`ditango::joint_attend`, `ditango::all_reduce_`, `ditango::tally`), opaque to the compiler
and given a fake implementation for its shapes, so a block compiles with no graph break. An
op finds the object that does the work by its handle (`register`): a ShardContext or a
TensorParallel. Eager runs call the objects directly, not through the ops.

A layer index reaches the ops as an int; `torch._dynamo.config.allow_unspec_int_on_nn_module`
makes it a symbolic input rather than a constant, so the blocks share one graph instead of
one per layer. A new item shape compiles again once (the shapes then become symbolic).

Compilation is lazy (at a block's first call). Where it fails (a missing compiler, an
unsupported op on the user's machine) the block runs eager from then on, every block with
it, with one warning line; the report records the reason (`CompileRecord`).
"""

from __future__ import annotations

import itertools
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch._inductor.exc
from torch._dynamo.utils import counters

# The objects the ops call, by handle; held weakly: a removed strategy's context (DiTango's
# caches with it) is freed as if it had never been registered.
_OBJECTS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)

# What a failed compile raises (dynamo wraps the backend's errors); anything else is the
# block's own (an exchange's timeout) and ends the item as it would eager.
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError)


def register(obj) -> int:
    """A handle the ops find `obj` by, for as long as `obj` lives."""
    handle = next(_HANDLES)
    _OBJECTS[handle] = obj
    return handle


@torch.library.custom_op("ditango::attend", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layer: int, handle: int) -> torch.Tensor:
    return _OBJECTS[handle].attention(q, k, v, scale, layer).contiguous()


@_attend.register_fake
def _(q, k, v, scale, layer, handle):
    return q.new_empty(q.shape)


@torch.library.custom_op("ditango::joint_attend", mutates_args=())
def _joint_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_text: torch.Tensor,
    k_text: torch.Tensor,
    v_text: torch.Tensor,
    scale: float,
    layer: int,
    handle: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, out_text = _OBJECTS[handle].joint_attention(q, k, v, q_text, k_text, v_text, scale, layer)
    return out.contiguous(), out_text.contiguous()


@_joint_attend.register_fake
def _(q, k, v, q_text, k_text, v_text, scale, layer, handle):
    return q.new_empty(q.shape), q_text.new_empty(q_text.shape)


@torch.library.custom_op("ditango::all_reduce_", mutates_args=("x",))
def _all_reduce_(x: torch.Tensor, handle: int) -> None:
    _OBJECTS[handle].all_reduce(x)


@_all_reduce_.register_fake
def _(x, handle):
    return None


@torch.library.custom_op("ditango::tally", mutates_args=("calls",))
def _tally(calls: torch.Tensor, x: torch.Tensor, handle: int) -> None:
    """Count `x` as `handle`'s object counts a result it exchanged (`count(x)`); `calls` (a
    counter the op increments) is what keeps the compiler from dropping a call with no result."""
    _OBJECTS[handle].count(x)
    calls.add_(1)


@_tally.register_fake
def _(calls, x, handle):
    return None


def attend(ctx, q, k, v, scale: float, layer: int) -> torch.Tensor:
    """`ctx.attention(q, k, v, scale, layer)`, through the op while a block is compiled."""
    if torch.compiler.is_compiling():
        return torch.ops.ditango.attend(q, k, v, scale, layer, ctx.handle)
    return ctx.attention(q, k, v, scale, layer)


def joint_attend(ctx, q, k, v, q_text, k_text, v_text, scale: float, layer: int):
    """`ctx.joint_attention(...)`, through the op while a block is compiled."""
    if torch.compiler.is_compiling():
        return torch.ops.ditango.joint_attend(q, k, v, q_text, k_text, v_text, scale, layer, ctx.handle)
    return ctx.joint_attention(q, k, v, q_text, k_text, v_text, scale, layer)


def all_reduce_(owner, x: torch.Tensor) -> None:
    """`owner.all_reduce(x)` (in place), through the op while a block is compiled."""
    if torch.compiler.is_compiling():
        torch.ops.ditango.all_reduce_(x, owner.handle)
    else:
        owner.all_reduce(x)


def tally(owner, x: torch.Tensor) -> None:
    """`owner.count(x)`, through the op while a block is compiled."""
    if torch.compiler.is_compiling():
        torch.ops.ditango.tally(owner.calls, x, owner.handle)
    else:
        owner.count(x)


@dataclass
class CompileRecord:
    """What the report says of compilation: whether it was asked, the blocks compiled, whether
    it fell back to eager and why, the compiles (graphs made: one for the blocks, one more
    once the layer index is symbolic, one per new item shape) and the seconds they took
    (`compile_s`: the calls that compiled, each with its own run)."""

    enabled: bool = False
    blocks: int = 0
    fallback: str | None = None
    compiles: int = 0
    compile_s: float = 0.0

    def to_json(self) -> dict:
        return {"enabled": self.enabled, "blocks": self.blocks, "compiles": self.compiles, "fallback": self.fallback}


class CompiledForward:
    """A block's forward, compiled, falling back to the eager forward for good (and for every
    block sharing `record`) where the compile fails."""

    def __init__(self, forward, record: CompileRecord, options: dict) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, **options)
        self.record = record

    def __call__(self, *args, **kwargs):
        record = self.record
        if record.fallback is not None:
            return self.eager(*args, **kwargs)
        graphs = counters["stats"]["unique_graphs"]
        started = time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except COMPILE_ERRORS as exc:  # the compiler's failure, not the block's: the run goes on eager
            reason = failure(exc)
            record.fallback = reason
            warnings.warn(f"--compile failed, running eager ({reason})", RuntimeWarning, stacklevel=2)
            return self.eager(*args, **kwargs)
        if counters["stats"]["unique_graphs"] > graphs:  # this call compiled
            record.compile_s += time.perf_counter() - started
            record.compiles += 1
        return out


def failure(exc: Exception) -> str:
    """One line of why a compile failed: the backend's own error where dynamo wrapped it."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    first = (str(inner).strip().splitlines() or [""])[0][:200]
    return (
        f"{type(exc).__name__}: {type(inner).__name__}: {first}"
        if inner is not exc
        else f"{type(exc).__name__}: {first}"
    )


def repeated_blocks(transformer) -> list[torch.nn.Module]:
    """The blocks a model repeats: diffusers names their classes (`_repeated_blocks`); FSDP2
    makes each block an instance of a subclass of its own."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    return [m for m in transformer.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def compile_blocks(transformers, record: CompileRecord, **options) -> CompileRecord:
    """Compile every repeated block of `transformers` in place (its `forward`; the module's
    hooks stay outside, eager). `options`: torch.compile's (tests pass a counting backend)."""
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    record.enabled = True
    for transformer in transformers:
        blocks = repeated_blocks(transformer)
        if not blocks:
            warnings.warn(
                f"--compile: {type(transformer).__name__} names no repeated block; it runs eager",
                RuntimeWarning,
                stacklevel=2,
            )
        for block in blocks:
            block.forward = CompiledForward(block.forward, record, options)
        record.blocks += len(blocks)
    return record


def uncompile_blocks(transformers) -> None:
    """Undo `compile_blocks` (the blocks' own forward again)."""
    for transformer in transformers:
        for block in repeated_blocks(transformer):
            if isinstance(block.__dict__.get("forward"), CompiledForward):
                del block.forward
