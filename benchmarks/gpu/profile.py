"""Measure a GPU and write a hardware profile for `ditango simulate --hardware-file`.

    python benchmarks/gpu/profile.py --name h200 --out benchmarks/gpu/h200.json

For a lent single-GPU machine (~10 minutes, no network). Needs only torch; uses
flash-attn and diffusers when they import (diffusers for one real-size Wan2.1-1.3B
transformer forward with random weights at 832x480x81 = 32,760 tokens), and says so
when they do not. Measures: dense bf16 matmul TFLOPS, dense fp8 (e4m3, torch._scaled_mm,
per-row scales as --quantize fp8 runs it; null below compute capability 8.9), attention-with-lse
TFLOPS per backend (torch flash, torch memory-efficient, flash-attn), HBM copy bandwidth, and the
compile factor: a Wan block's elementwise chain (norm, modulation, gated residual) compiled by
torch.compile over eager (planner/precision.py scales the modelled elementwise work by it). Link
bandwidths cannot be measured on one GPU: the profile keeps the datasheet values given on
the command line, and says so. Standalone on purpose (no project imports), so it runs
where the project is not installed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def matmul_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b) / 1e12


def fp8_matmul_tflops(n: int = 8192) -> float | None:
    """Dense e4m3 matmul with per-row / per-column float32 scales; None without FP8 tensor cores."""
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    try:
        return 2 * n**3 / timed(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)) / 1e12
    except RuntimeError:  # a torch without row-wise scaling: one scale per tensor
        one = torch.ones((), device="cuda")
        return 2 * n**3 / timed(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)) / 1e12


def compile_factor(tokens: int = 32760, width: int = 5120) -> float | str:
    """Compiled over eager time of a Wan block's elementwise chain on [tokens, width] bf16 (at most 1)."""

    def chain(h, attn, scale, shift, gate):
        n = (torch.nn.functional.layer_norm(h.float(), (h.shape[-1],)) * (1 + scale) + shift).type_as(h)
        return (h.float() + (attn + n) * gate).type_as(h)

    h, attn = (torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale, shift, gate = (torch.randn(1, width, device="cuda") for _ in range(3))
    try:
        compiled = torch.compile(chain)
        eager_s = timed(lambda: chain(h, attn, scale, shift, gate))
        compiled_s = timed(lambda: compiled(h, attn, scale, shift, gate))
    except Exception as exc:  # inductor missing a compiler or triton: not measured
        return f"failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return round(min(1.0, compiled_s / eager_s), 3)


def hbm_tbps(numel: int = 1 << 28) -> float:
    src = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src)) / 1e12


def attention_tflops(seq: int = 8192, heads: int = 12, dim: int = 128) -> dict[str, float]:
    q, k, v = (torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * seq * seq * heads * dim
    out = {}
    ops = {
        "torch_flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False),
        "torch_efficient": lambda: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True),
    }
    try:
        from flash_attn import flash_attn_func

        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        ops["flash_attn"] = lambda: flash_attn_func(qs, ks, vs, return_attn_probs=True)
    except ImportError:
        out["flash_attn"] = None
    for name, fn in ops.items():
        try:
            out[name] = flops / timed(fn, reps=10) / 1e12
        except RuntimeError as exc:  # a kernel not built for this GPU/dtype
            out[name] = f"failed: {str(exc).splitlines()[0]}"
    return out


def wan_step_s() -> float | str:
    try:
        from diffusers import WanTransformer3DModel
    except ImportError:
        return "skipped: diffusers not importable here"
    cfg = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )  # Wan2.1-T2V-1.3B
    model = WanTransformer3DModel(**cfg).to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.bfloat16)  # 832x480x81
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500.0], device="cuda")
    with torch.no_grad():
        return timed(lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False), reps=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--intra-gbps", type=float, default=450.0, help="datasheet NVLink per direction")
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="datasheet NIC per GPU")
    ap.add_argument("--latency-us", type=float, default=10.0)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    attn = attention_tflops()
    best_attn = max((v for v in attn.values() if isinstance(v, float)), default=None)
    mm, fp8, factor = matmul_tflops(), fp8_matmul_tflops(), compile_factor()
    profile = {
        "name": args.name,
        "bf16_tflops": round(mm, 1),
        "fp8_tflops": None if fp8 is None else round(fp8, 1),  # achieved, as bf16_tflops
        "compile_factor": factor if isinstance(factor, float) else 1.0,
        "hbm_tbps": round(hbm_tbps(), 3),
        "intra_gbps": args.intra_gbps,
        "inter_gbps": args.inter_gbps,
        "latency_us": args.latency_us,
        "source": f"measured on {torch.cuda.get_device_name()} (torch {torch.__version__}); links from datasheet",
        "measured": {
            "attention_tflops": attn,
            "best_attention_over_matmul": None if best_attn is None else round(best_attn / mm, 3),
            "compile_factor": factor,
            "wan2.1_1.3b_forward_s_832x480x81": wan_step_s(),
        },
    }
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=2)
    print(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
