"""The exact context-parallel attention: ring, Ulysses and USP as one composition.

Ulysses (head all-to-all) over `ulysses_degree` adjacent cp ranks, then ring attention over
the remaining `ring_degree`; ring is USP with ulysses_degree 1, Ulysses is USP with
ring_degree 1.

Shape legend: B batch, S tokens (local chunk), H heads, D head dim.
"""

from __future__ import annotations

import torch

from runtime.kernels import attention, attention_output
from runtime.state import AttentionState, merge
from runtime.strategies.ring import ring_attention
from runtime.strategies.ulysses import heads_to_seq, seq_to_heads


def with_extra(state: AttentionState, q_BSHD, extra_kv, scale: float, backend) -> AttentionState:
    """`state` merged with the queries' state over a partition every rank holds whole (None: none)."""
    if extra_kv is None:
        return state
    return merge(state, attention(q_BSHD, *extra_kv, scale, backend))


def whole_attention(q_BSHD, k_BSHD, v_BSHD, scale: float, backend, extra_kv=None) -> torch.Tensor:
    """Attention over a sequence this rank holds whole, plus `extra_kv`: without it one kernel
    call and no state (nothing to merge), [B, S, H, D] in q's dtype."""
    if extra_kv is None:
        return attention_output(q_BSHD, k_BSHD, v_BSHD, scale, backend)
    state = attention(q_BSHD, k_BSHD, v_BSHD, scale, backend)
    return with_extra(state, q_BSHD, extra_kv, scale, backend).out_BSHD.to(q_BSHD.dtype)


class ExactAttention:
    """Every KV chunk fresh, every step: the exact baselines (and DiTango's exact runs)."""

    def attend(self, ctx, q_BSHD, k_BSHD, v_BSHD, scale: float, layer: int = 0, extra_kv=None) -> torch.Tensor:
        """Attention of the local queries over the whole sequence of `ctx` (a ShardContext), plus
        `extra_kv`; [B, S, H, D] in q's dtype."""
        mesh, comm, backend = ctx.mesh, ctx.comm, ctx.backend
        u, r = mesh.layout.ulysses, mesh.layout.ring
        dtype = q_BSHD.dtype
        if ctx.cp == 1:
            return whole_attention(q_BSHD, k_BSHD, v_BSHD, scale, backend, extra_kv)
        ring_me, uly_me = divmod(mesh.cp_index, u)
        # Ulysses group = cp indices [ring_me * u, (ring_me + 1) * u): their chunk sizes.
        uly_sizes = ctx.seq_sizes[ring_me * u : (ring_me + 1) * u]
        if u > 1:
            qkv = seq_to_heads((q_BSHD, k_BSHD, v_BSHD), uly_sizes, comm, mesh.ulysses_ranks, mesh.ulysses_group)
            q_BSHD, k_BSHD, v_BSHD = qkv.unbind(dim=2)
            if extra_kv is not None:  # this member's heads of the whole-held partition (seq_to_heads' split)
                h = q_BSHD.shape[2]
                extra_kv = tuple(t[:, :, uly_me * h : (uly_me + 1) * h] for t in extra_kv)
        if r > 1:
            spans = [sum(ctx.seq_sizes[i * u : (i + 1) * u]) for i in range(r)]
            state = ring_attention(
                q_BSHD,
                k_BSHD,
                v_BSHD,
                scale=scale,
                backend=backend,
                comm=comm,
                ring_ranks=mesh.ring_ranks,
                ring_group=mesh.ring_group,
                kv_sizes=spans,
            )
            out = with_extra(state, q_BSHD, extra_kv, scale, backend).out_BSHD.to(dtype)
        else:  # Ulysses alone: every member holds the whole sequence of its heads
            out = whole_attention(q_BSHD, k_BSHD, v_BSHD, scale, backend, extra_kv)
        if u > 1:
            out = heads_to_seq(out, uly_sizes, uly_me, comm, mesh.ulysses_ranks, mesh.ulysses_group)
        return out


EXACT = ExactAttention()


def build(ctx, transformers, options) -> ExactAttention:
    """Ring, Ulysses and USP (planner/strategies/exact.py): the composition the mesh's degrees set."""
    return EXACT
