"""Ulysses: trade the sequence split for a head split with one all-to-all, and back.

Shape legend: B batch, S local tokens, T tokens of the whole Ulysses group (sum of its
members' chunks), G packed tensors (q, k, v), H heads, h = H / u heads per member, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.comm import Comm


def seq_to_heads(
    xs_BSHD: Sequence[torch.Tensor], seq_sizes: Sequence[int], comm: Comm, ranks: Sequence[int], group
) -> torch.Tensor:
    """G tensors [B, S_me, H, D] sequence-sharded -> [B, T, G, h, D] head-sharded (T = sum seq_sizes)."""
    u = len(ranks)
    B, S, H, D = xs_BSHD[0].shape
    h = H // u
    # Rows for member j: our S tokens, heads [j*h, (j+1)*h), each tensor copied once into place.
    send = xs_BSHD[0].new_empty(u, S, B, len(xs_BSHD), h, D)
    for g, x_BSHD in enumerate(xs_BSHD):
        send[:, :, :, g].copy_(x_BSHD.reshape(B, S, u, h, D).permute(2, 1, 0, 3, 4))
    recv_TBGhD = comm.all_to_all(send.view(u * S, B, len(xs_BSHD), h, D), [S] * u, list(seq_sizes), ranks, group)
    return recv_TBGhD.permute(1, 0, 2, 3, 4)


def heads_to_seq(
    y_BThD: torch.Tensor, seq_sizes: Sequence[int], me: int, comm: Comm, ranks: Sequence[int], group
) -> torch.Tensor:
    """[B, T, h, D] head-sharded -> [B, S_me, H, D] sequence-sharded (inverse of seq_to_heads)."""
    u = len(ranks)
    B, _, h, D = y_BThD.shape
    S = seq_sizes[me]
    send = y_BThD.permute(1, 0, 2, 3).contiguous()  # member j gets its own chunk's rows
    recv = comm.all_to_all(send, list(seq_sizes), [S] * u, ranks, group)  # rows by head group j
    return recv.reshape(u, S, B, h, D).permute(2, 1, 0, 3, 4).reshape(B, S, u * h, D)
