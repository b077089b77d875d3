"""Ring attention: every ring member's KV block visits every rank once.

Shape legend: B batch, S local query tokens, K tokens of a KV block, H heads, D head dim.

Step s computes on the block that originated at ring index (me - s) mod P while the
next block travels: the receive for step s+1 is posted before step s is computed
(overlap). Blocks may differ in length (uneven chunks); each receiver knows the size of
the block it will get from the shared size list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.comm import Comm
from runtime.kernels import Backend, attention
from runtime.state import AttentionState, merge


def ring_attention(
    q_BSHD: torch.Tensor,
    k_BKHD: torch.Tensor,
    v_BKHD: torch.Tensor,
    *,
    scale: float,
    backend: Backend,
    comm: Comm,
    ring_ranks: Sequence[int],
    ring_group,
    kv_sizes: Sequence[int],
    include_own: bool = True,
) -> AttentionState:
    """Attention of local queries over the union of all ring members' KV blocks (without the
    rank's own block when not `include_own`: it still travels, for the others)."""
    P = len(ring_ranks)
    me = ring_ranks.index(comm.mesh.rank)
    B, _, H, D = k_BKHD.shape
    kv = (k_BKHD, v_BKHD)  # two messages per hop, no copy into one
    state: AttentionState | None = None
    for step in range(P):
        pending = None
        if step < P - 1:
            origin = (me - step - 1) % P  # the block our predecessor holds now
            shape = (B, kv_sizes[origin], H, D)
            pending = comm.exchange(
                kv,
                dst=ring_ranks[(me + 1) % P],
                src=ring_ranks[(me - 1) % P],
                recv_shape=(shape, shape),
                group=ring_group,
            )
        if step > 0 or include_own:
            state = merge(state, attention(q_BSHD, *kv, scale, backend))
        if pending is not None:
            kv = pending.wait()
    assert state is not None
    return state
