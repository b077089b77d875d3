"""Attention-state algebra: any split of the keys, merged in any order, is full attention."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.kernels import attention, reference_attention
from runtime.state import AttentionState, merge, merge_all

FP32_ATOL = 2e-6  # fp32 rounding of a few merges at unit-scale values


def qkv(b, s, k, h, d, seed=0, scale_q=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g) * scale_q
    return q, torch.randn(b, k, h, d, generator=g), torch.randn(b, k, h, d, generator=g)


def split_points(n, parts, rng):
    cuts = sorted(rng.sample(range(1, n), parts - 1))
    return [0, *cuts, n]


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize(
    "sizes",
    [[1, 63], [63, 1], [1, 1, 62], [32, 32], [5, 17, 9, 1, 32], [1] * 8 + [56]],
)
def test_any_split_merges_to_full_attention(backend, sizes):
    q, k, v = qkv(2, 7, sum(sizes), 3, 16, seed=len(sizes))
    scale = 16**-0.5
    ref_out, ref_lse = reference_attention(q, k, v, scale)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    states = [attention(q, k[:, a:b], v[:, a:b], scale, backend) for a, b in zip(bounds, bounds[1:], strict=False)]
    rng = random.Random(sum(sizes))
    for order in range(3):
        perm = list(range(len(states)))
        rng.shuffle(perm)
        pairwise = None
        for i in perm:
            pairwise = merge(pairwise, states[i])
        nway = merge_all([states[i] for i in perm])
        for got in (pairwise, nway):
            assert (got.out_BSHD.double() - ref_out).abs().max() <= FP32_ATOL, order
            assert (got.lse_BSH.double() - ref_lse).abs().max() <= FP32_ATOL, order


def test_random_splits_with_peaked_scores():
    """Large logits (lse ~ 100): the naive exp form would overflow fp32's exp range."""
    q, k, v = qkv(1, 9, 40, 2, 8, seed=5, scale_q=40.0)
    ref_out, ref_lse = reference_attention(q, k, v, 1.0)
    # An fp32 lse of magnitude ~400 is only known to its ulp (~3e-5), and merge weights
    # exp(lse_i - lse) inherit that relative error: the bound is eps32 * max|lse|.
    tol = torch.finfo(torch.float32).eps * ref_lse.abs().max().item()
    rng = random.Random(0)
    for _ in range(5):
        b = split_points(40, 4, rng)
        states = [attention(q, k[:, x:y], v[:, x:y], 1.0, "sdpa") for x, y in zip(b, b[1:], strict=False)]
        got = merge_all(states)
        assert torch.isfinite(got.out_BSHD).all()
        assert (got.out_BSHD.double() - ref_out).abs().max() <= tol
        assert (got.lse_BSH.double() - ref_lse).abs().max() / ref_lse.abs().max() <= 1e-6


def test_empty_states_and_infinite_rows():
    q, k, v = qkv(1, 4, 6, 2, 8)
    s = attention(q, k, v, 0.3, "sdpa")
    assert merge(None, None) is None
    assert merge(s, None) is s and merge(None, s) is s
    assert merge_all([None, None]) is None
    # A partition with no key for some rows (lse = -inf, e.g. fully masked): the other side wins.
    lse = s.lse_BSH.clone()
    lse[:, :2] = float("-inf")
    masked = AttentionState(torch.zeros_like(s.out_BSHD), lse)
    for got in (merge(masked, s), merge(s, masked), merge_all([masked, s])):
        assert torch.allclose(got.out_BSHD[:, :2], s.out_BSHD[:, :2], atol=1e-6)
        assert torch.isfinite(got.lse_BSH).all()
    both = AttentionState(torch.zeros_like(s.out_BSHD), torch.full_like(lse, float("-inf")))
    got = merge(both, both)
    assert not torch.isnan(got.out_BSHD).any() and torch.isneginf(got.lse_BSH).all()


def test_bf16_kernel_state_is_float32():
    q, k, v = qkv(1, 5, 8, 2, 16)
    s = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25, "sdpa")
    assert s.out_BSHD.dtype == torch.float32 and s.lse_BSH.dtype == torch.float32
    ref_out, _ = reference_attention(q, k, v, 0.25)
    assert (s.out_BSHD.double() - ref_out).abs().max() < 3e-2  # bf16 inputs, fp32 state
