"""Attention states and their merge (docs/ALGORITHMS.md section 1).

Shape legend: B batch, S query tokens, H heads, D head dim.

The state of a query row over a KV partition P is (out_P, lse_P) with
    lse_P = log sum_{j in P} exp(s_j),   out_P = sum_{j in P} exp(s_j - lse_P) v_j.
States of disjoint partitions merge associatively and commutatively into the state
of their union; merging every partition equals full attention. States are always kept
in float32, whatever dtype the kernel ran in. The empty state is `None`, never
(0, -inf): a pairwise merge of two -inf lse values would produce NaN.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from runtime.profiling import region


@dataclass(frozen=True)
class AttentionState:
    out_BSHD: torch.Tensor  # float32
    lse_BSH: torch.Tensor  # float32, natural log

    def __post_init__(self) -> None:
        assert self.out_BSHD.dtype == torch.float32 and self.lse_BSH.dtype == torch.float32
        assert self.out_BSHD.shape[:3] == self.lse_BSH.shape, (self.out_BSHD.shape, self.lse_BSH.shape)

    @classmethod
    def from_kernel(cls, out_BSHD: torch.Tensor, lse_BSH: torch.Tensor) -> AttentionState:
        return cls(out_BSHD.float(), lse_BSH.float())

    def __repr__(self) -> str:
        return f"AttentionState(out_BSHD={tuple(self.out_BSHD.shape)}, lse_BSH={tuple(self.lse_BSH.shape)})"

    def nbytes(self) -> int:
        return self.out_BSHD.numel() * 4 + self.lse_BSH.numel() * 4


def merge(a: AttentionState | None, b: AttentionState | None) -> AttentionState | None:
    """State of the union of two disjoint KV partitions.

    Naive form:  lse = log(e^lse_a + e^lse_b),
                 out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b).
    Stable form used here (no exp of a large lse; ring-flash-attention, PyTorch):
                 out = out_a + sigmoid(lse_b - lse_a) * (out_b - out_a)
                 lse = logaddexp(lse_a, lse_b)   (= lse_a - logsigmoid(lse_a - lse_b),
                       but also exact when one side is -inf, where that form gives NaN)
    A row whose lse is -inf on one side (no key there) takes the other side.
    """
    if a is None:
        return b
    if b is None:
        return a
    with region("merge"):
        return _merge(a, b)


def _merge(a: AttentionState, b: AttentionState) -> AttentionState:
    # Five kernels, the weight computed in place. Rows empty on both sides give NaN weights
    # (inf - inf): they count as 0, so such rows keep side a.
    weight_b = torch.sub(b.lse_BSH, a.lse_BSH).sigmoid_().nan_to_num_(nan=0.0)
    out = torch.lerp(a.out_BSHD, b.out_BSHD, weight_b.unsqueeze(-1))  # out_a + w (out_b - out_a)
    return AttentionState(out, torch.logaddexp(a.lse_BSH, b.lse_BSH))


def merge_all(states: Iterable[AttentionState | None]) -> AttentionState | None:
    """n-way merge: logsumexp over the stacked lse; non-finite weights count as zero."""
    present = [s for s in states if s is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    with region("merge"):
        return _merge_all(present)


def _merge_all(present: list[AttentionState]) -> AttentionState:
    lse_NBSH = torch.stack([s.lse_BSH for s in present])
    total = torch.logsumexp(lse_NBSH, dim=0)
    weights = torch.exp(lse_NBSH - total)
    weights = torch.where(torch.isfinite(weights), weights, torch.zeros_like(weights))
    out = sum(w.unsqueeze(-1) * s.out_BSHD for w, s in zip(weights, present, strict=True))
    return AttentionState(out, total)
