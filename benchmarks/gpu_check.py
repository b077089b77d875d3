"""GPU-only checks (run on a machine with CUDA; the CPU suite never depends on them).

    python benchmarks/gpu_check.py

1. Every attention backend that exists here (torch fused: flash for fp16/bf16 and
   memory-efficient for fp32; flash-attn when installed) returns an attention state
   whose merge over a split of the keys matches the float64 reference.
2. `ditango generate` on the built-in model runs on CUDA in bfloat16 and float32
   (one rank; ring over one rank exercises our processor and kernels).
Prints a table; exits 1 if any check fails.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from runtime.kernels import attention, flash_attn_available, reference_attention
from runtime.state import merge_all

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def kernel_rows() -> list[tuple[str, str, float, bool]]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    backends = ["torch"] + (["flash"] if flash_attn_available() else [])
    for backend in backends:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            if backend == "flash" and dtype == torch.float32:
                continue  # flash-attn has no fp32 kernel
            B, S, K, H, D = 2, 333, 1000, 8, 64
            q, k, v = (torch.randn(B, n, H, D, device="cuda", generator=g, dtype=dtype) for n in (S, K, K))
            ref, _ = reference_attention(q, k, v, D**-0.5)
            cuts = [0, 1, 300, 301, 777, K]
            states = [
                attention(q, k[:, a:b], v[:, a:b], D**-0.5, backend) for a, b in zip(cuts, cuts[1:], strict=False)
            ]
            err = (merge_all(states).out_BSHD.double() - ref).abs().max().item()
            rows.append((backend, str(dtype).removeprefix("torch."), err, err <= TOL[dtype]))
    return rows


def generate_rows() -> list[tuple[str, str, float, bool]]:
    rows = []
    exe = Path(sys.executable).with_name("ditango")
    for dtype in ("bfloat16", "float32"):
        for parallel in ("none", "ring"):
            with tempfile.TemporaryDirectory() as out:
                cmd = [str(exe), "generate", "--prompt", "a red circle", "--out", out, "--device", "cuda",
                       "--dtype", dtype, "--parallel", parallel, "--quiet"]  # fmt: skip
                ok = subprocess.run(cmd).returncode == 0 and any(Path(out).glob("*.mp4"))
            rows.append((f"generate --parallel {parallel}", dtype, float("nan"), ok))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    rows = kernel_rows() + generate_rows()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}\n")
    print("| check | dtype | max abs err vs fp64 | ok |")
    print("|---|---|---:|---|")
    for name, dtype, err, ok in rows:
        print(f"| {name} | {dtype} | {err:.2e} | {'yes' if ok else 'NO'} |")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
