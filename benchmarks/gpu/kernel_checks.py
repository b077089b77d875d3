"""Section 1 of benchmarks/gpu_check.py: the attention-state contract of every kernel
`--attention` accepts on the device (runtime/kernels.py), against float64 and SDPA. Takes a
device and the kernels, so the CPU suite runs it on sdpa and reference (tests/test_gpu_check.py).

Shape legend: B batch, S query tokens, K key tokens, H heads, D head dim.
"""

from __future__ import annotations

import torch

from basics.errors import ConfigError
from benchmarks.gpu.runtime_checks import Row, _rand
from runtime.kernels import attention, attention_output, reference_attention, resolve_backend
from runtime.state import merge_all

# Max abs error of out against float64, per compute dtype (inputs ~ N(0, 1)).
OUT_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LSE_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def available_kernels(device: str, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The kernels `--attention` accepts on `device` for `dtype` (sdpa always)."""

    def runs(name: str) -> bool:
        try:
            return resolve_backend(name, torch.device(device), dtype) == name
        except ConfigError:
            return False

    return [k for k in ("sdpa", "flash", "flash3") if runs(k)]


def kernel_rows(
    device: str = "cuda",
    backends: list[str] | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32),
    head_dims: tuple[int, ...] = (48, 128),
    lengths: tuple[int, int] = (333, 1000),
) -> list[Row]:
    """The attention-state contract of every backend (benchmarks/gpu_check.py's section 1)."""
    if backends is None:
        backends = available_kernels(device)
    g = torch.Generator(device=device).manual_seed(0)
    S, K = lengths
    B, H = 2, 3
    rows = []
    for backend in backends:
        for dtype in dtypes:
            if backend in ("flash", "flash3") and dtype == torch.float32:
                continue  # flash-attn has no fp32 kernel
            for D in head_dims:
                scale = D**-0.5
                cases = {
                    f"S={S} K={K}": (S, K, False),
                    "1-token query": (1, K, False),
                    "1-token keys": (S, 1, False),
                    "permuted strides": (S, K, True),
                }
                for case, (s, k_len, permuted) in cases.items():
                    if permuted:  # [B, H, S, D] storage seen as [B, S, H, D]: non-contiguous
                        q, k, v = (_rand((B, H, n, D), dtype, device, g).transpose(1, 2) for n in (s, k_len, k_len))
                    else:
                        q, k, v = (_rand((B, n, H, D), dtype, device, g) for n in (s, k_len, k_len))
                    name = f"{backend} {str(dtype).removeprefix('torch.')} D={D} {case}"
                    rows.extend(_kernel_case(name, q, k, v, scale, backend, dtype))
    return rows


def _kernel_case(name, q, k, v, scale, backend, dtype) -> list[Row]:
    ref_out, ref_lse = reference_attention(q, k, v, scale)
    state = attention(q, k, v, scale, backend)
    B, S, H, _ = q.shape
    contract = (
        state.lse_BSH.shape == (B, S, H)
        and state.lse_BSH.dtype == torch.float32
        and state.out_BSHD.dtype == torch.float32
        and bool(torch.isfinite(state.lse_BSH).all())
        and bool(torch.isfinite(state.out_BSHD).all())
    )
    out_err = (state.out_BSHD.double() - ref_out).abs().max().item()
    lse_err = (state.lse_BSH.double() - ref_lse).abs().max().item()
    K = k.shape[1]
    cuts = sorted({0, min(1, K), K // 3, K // 3 + 1, (2 * K) // 3 + 5, K} & set(range(K + 1)))
    parts = [attention(q, k[:, a:b], v[:, a:b], scale, backend) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    merged = merge_all(parts)
    merge_err = (merged.out_BSHD - state.out_BSHD).abs().max().item()
    merge_lse_err = (merged.lse_BSH - state.lse_BSH).abs().max().item()
    tol, lse_tol = OUT_TOL[dtype], LSE_TOL[dtype]
    only_err = (attention_output(q, k, v, scale, backend).double() - state.out_BSHD.double()).abs().max().item()
    rows = [
        Row("kernels", f"{name}: lse [B,S,H] float32, finite", float(contract), "1", contract),
        Row("kernels", f"{name}: out vs float64", out_err, f"<= {tol:g}", out_err <= tol),
        Row("kernels", f"{name}: lse vs float64", lse_err, f"<= {lse_tol:g}", lse_err <= lse_tol),
    ]
    if backend != "sdpa":  # two kernels, each within the limits of float64: within twice them of each other
        sdpa = attention(q, k, v, scale, "sdpa")
        share = max(
            (state.out_BSHD - sdpa.out_BSHD).abs().max().item() / tol,
            (state.lse_BSH - sdpa.lse_BSH).abs().max().item() / lse_tol,
        )
        rows.append(Row("kernels", f"{name}: out, lse vs sdpa (share of the limits)", share, "<= 2", share <= 2))
    return rows + [
        Row("kernels", f"{name}: output-only call vs the state's out", only_err, f"<= {tol:g}", only_err <= tol),
        Row(
            "kernels",
            f"{name}: merge of {len(parts)} uneven splits vs one-shot (out, lse)",
            max(merge_err, merge_lse_err),
            f"<= {tol:g}",
            merge_err <= tol and merge_lse_err <= lse_tol,
        ),
    ]
