"""Single-GPU acceptance checks: numbers with limits, not only "an MP4 appeared".

    python benchmarks/gpu_check.py [--skip generate] [--json out.json]

On one CUDA GPU (sized for a few minutes on an H200; the budget is 10). Needs the project's
dependencies (diffusers, transformers, submitit, imageio, imageio-ffmpeg; flash-attn when
installed). Prints one markdown table and exits 1 when any row fails. Sections:

1. kernels: every attention kernel this GPU runs (sdpa; flash where flash-attn imports; flash3
   on Hopper where FlashAttention-3 imports) in bf16, fp16 and fp32 (flash, flash3: no fp32
   kernel), head dims 48 and 128, on odd lengths, a 1-token query and a 1-token key block, and
   permuted (non-contiguous) strides: the state's lse is [B, S, H] float32 and finite, out and
   lse match float64 (and sdpa's, for the others), the output-only call matches the state's
   out, and merging the states of an uneven split of the keys equals one-shot attention;
2. nccl: a one-rank NCCL world (device bound) and a hand-built mesh whose ring members are
   all this rank: the real `Comm` (P2P to itself, gather), ring attention and the DiTango
   runtime (fetch, cache, reuse, plan check) run over NCCL; with every member holding the
   same KV, attention over k copies equals attention over one, lse + log k;
3. processor: Wan2.1-1.3B geometry (12 heads x 128, 30 layers) with random weights at
   832x480x81 (32,760 tokens) in bf16: our context-parallel processor (one rank) against
   diffusers' own, relative difference, time per forward and peak memory; diffusers' own
   attention set to every other kernel (one rank, runtime/kernels.py use_on_one_rank) against
   its native SDPA;
4. cache: DiTango's cache allocated at its target size (Wan2.1-14B, 1280x720x81 = 75,600
   tokens, CP 16, groups of 2, two CFG branches, bf16): bytes equal the formula, the
   automatic cap from free memory, a user cap that composes, memory returned after the item;
5. generate: `ditango generate --executor local` on the built-in model on CUDA (bf16, fp32;
   one rank, and ring over one rank), each run bounded by GENERATE_TIMEOUT_S: latents against
   the CPU float32 run of the same prompt and seed;
6. sharding: FSDP2 (runtime/weights.py) and DTensor tensor parallelism (wan.install_tp) on a
   one-rank NCCL mesh, which the runtime skips on one rank: a random-weight Wan forward
   equals the whole model's, and every TP shard owns only its own bytes;
7. memory: the memory model against `torch.cuda.max_memory_allocated` for one
   Wan2.1-14B-width block at 75,600 tokens in bf16 and a random-weight Wan VAE decode at
   1280x720x81, untiled and tiled;
8. compile: `--compile` on a 2-block Wan2.1-1.3B-width random transformer (bf16, 8,190 tokens,
   ring over one rank: the `ditango::` custom ops): no graph break or fallback, one graph for
   the blocks, compiled vs eager relative L2 and max error, median time per forward;
9. fp8 (compute capability >= 8.9; one line saying so below): `Fp8Linear` vs the bf16 Linear
   at Wan2.1-14B's widths and 8k-32k tokens (relative error; time eager and compiled), and a
   2-block Wan forward quantized whole vs bf16.

Section 1 is in benchmarks/gpu/kernel_checks.py, 2 and 4 in benchmarks/gpu/runtime_checks.py, 6 and 7
in benchmarks/gpu/model_checks.py, 8 in benchmarks/gpu/compile_checks.py, 9 in
benchmarks/gpu/fp8_checks.py.
The CPU suite runs sections 1, 3, 4, 6, 7, 8 and 9 on the CPU at small sizes (7's peak traced by
torch's MemTracker; 8 traced by dynamo's "eager" backend; 9's times only printed), and section 2's
bring-up and collectives over gloo (tests/test_gpu_check.py);
section 5 and the P2P of section 2 need CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from basics.errors import ConfigError  # noqa: E402
from benchmarks.gpu.compile_checks import compile_rows  # noqa: E402
from benchmarks.gpu.fp8_checks import fp8_rows  # noqa: E402
from benchmarks.gpu.kernel_checks import available_kernels, kernel_rows  # noqa: E402
from benchmarks.gpu.model_checks import memory_rows, sharding_rows  # noqa: E402
from benchmarks.gpu.runtime_checks import Row, cache_rows, nccl_rows, random_wan  # noqa: E402
from runtime.kernels import flash3_available, flash_attn_available, resolve_backend, use_on_one_rank  # noqa: E402

GENERATE_TIMEOUT_S = 300  # one built-in-model run takes seconds on a GPU; a hang fails its row


# -- 3. our processor against diffusers' --------------------------------------------------------
WAN_1_3B = dict(
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
    eps=1e-6,
    rope_max_seq_len=1024,
)


def processor_rows(
    device: str = "cuda",
    config: dict | None = None,
    latent_shape: tuple[int, int, int] = (21, 60, 104),  # 832x480x81 through Wan2.1's VAE
    dtype: torch.dtype = torch.bfloat16,
    text_len: int = 512,
    rel_tol: float = 2e-2,
    reps: int = 3,
) -> list[Row]:
    """One transformer forward with diffusers' processors and with ours (context parallelism
    on one rank: sharding hooks, our processor and kernels), same random weights and inputs."""

    from planner.layout import ParallelLayout
    from runtime.comm import Comm
    from runtime.kernels import resolve_backend
    from runtime.mesh import build_mesh
    from runtime.strategies import parallelize

    model, forward = random_wan(config or WAN_1_3B, latent_shape, text_len, dtype, device)

    def measure() -> tuple[torch.Tensor, float, int]:
        out = forward()  # warm-up (and the result)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for _ in range(reps):
            forward()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = 0
        return out.float(), (time.perf_counter() - start) / reps, peak

    ref, ref_s, ref_peak = measure()
    rows = one_rank_rows(model, forward, ref, device, dtype, rel_tol)
    backend = resolve_backend("auto", torch.device(device), dtype)
    mesh = build_mesh(ParallelLayout(strategy="ring"), 0, (0,), device=torch.device(device))
    handles = parallelize(model, mesh, Comm(mesh), backend)
    installed = all(type(b.attn1.processor).__name__ == "WanSelfAttention" for b in model.blocks)
    ours, ours_s, ours_peak = measure()
    handles.remove()
    rel = ((ours - ref).norm() / ref.norm()).item()
    F, Hl, Wl = latent_shape
    tokens = F * (Hl // 2) * (Wl // 2)
    rows += [
        Row(
            "processor",
            f"{tokens} tokens, ours ({backend}) vs diffusers: relative difference",
            rel,
            f"<= {rel_tol:g}",
            rel <= rel_tol and installed and bool(torch.isfinite(ours).all()),
        ),
    ]
    if device == "cuda":
        rows += [
            Row(
                "processor",
                f"time per forward: diffusers {ref_s:.3f} s, ours {ours_s:.3f} s (ratio)",
                ours_s / ref_s,
                "<= 1.5",
                ours_s / ref_s <= 1.5,
            ),
            Row(
                "processor",
                f"peak memory: diffusers {ref_peak / 2**30:.2f} GiB, ours {ours_peak / 2**30:.2f} GiB (ratio)",
                ours_peak / max(1, ref_peak),
                "<= 1.5",
                ours_peak <= 1.5 * max(1, ref_peak),
            ),
        ]
    return rows


def one_rank_rows(model, forward, ref, device: str, dtype: torch.dtype, rel_tol: float) -> list[Row]:
    """diffusers' own attention (one rank) set to each kernel other than sdpa that `--attention`
    accepts here for one rank, against its native SDPA (`ref`); left on native after."""
    rows = []
    for kernel in available_kernels(device, dtype)[1:]:
        try:
            resolve_backend(kernel, torch.device(device), dtype, one_rank=True)
        except ConfigError as exc:  # diffusers' dispatch does not find it: said, not failed
            rows.append(Row("processor", f"one rank, {kernel}: {exc}", math.nan, "-", True))
            continue
        use_on_one_rank([model], kernel)
        with torch.no_grad():
            got = forward().float()
        use_on_one_rank([model], "sdpa")
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = rel <= rel_tol and bool(torch.isfinite(got).all())
        rows.append(
            Row("processor", f"one rank, diffusers' attention on {kernel} vs native", rel, f"<= {rel_tol:g}", ok)
        )
    return rows


# -- 5. generate on CUDA against the CPU ---------------------------------------------------------
def generate_rows() -> list[Row]:
    from safetensors.torch import load_file

    exe = [sys.executable, "-c", "from ditango_cli.app import main; main()"]
    # --executor local: on a Slurm node `auto` would submit the two-rank run as a job
    base = [
        "generate",
        "--prompt",
        "a red circle moving left on a black background",
        "--save-latents",
        "--quiet",
        "--executor",
        "local",
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:

        def run(name: str, *extra: str) -> torch.Tensor | None:
            out = Path(tmp) / name
            try:
                done = subprocess.run([*exe, *base, "--out", str(out), *extra], cwd=ROOT, timeout=GENERATE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return None  # a hung run is a failed row, not a hung check
            files = list(out.glob("*.latents.safetensors"))
            return load_file(files[0])["latents"] if done.returncode == 0 and files else None

        cpu = run("cpu", "--device", "cpu")
        for dtype, tol in (("float32", 1e-2), ("bfloat16", 1e-1)):
            for parallel in ("none", "ring"):
                got = run(f"{dtype}-{parallel}", "--device", "cuda", "--dtype", dtype, "--parallel", parallel)
                if got is None or cpu is None:
                    rows.append(Row("generate", f"--parallel {parallel} {dtype}: did not run", math.nan, "-", False))
                    continue
                rel = ((got - cpu).norm() / cpu.norm()).item()
                rows.append(
                    Row(
                        "generate",
                        f"--parallel {parallel} {dtype}: latents vs CPU float32 (relative)",
                        rel,
                        f"<= {tol:g}",
                        rel <= tol,
                    )
                )
    return rows


SECTIONS: dict[str, Callable[[], list[Row]]] = {
    "kernels": kernel_rows,
    "nccl": nccl_rows,
    "processor": processor_rows,
    "cache": cache_rows,
    "generate": generate_rows,
    "sharding": sharding_rows,
    "memory": memory_rows,
    "compile": compile_rows,
    "fp8": fp8_rows,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", action="append", default=[], choices=list(SECTIONS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU-checkable parts run in tests/test_gpu_check.py)")
        return 1
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flash-attn: {flash_attn_available()}, "
        f"FlashAttention-3: {flash3_available()}, kernels: {', '.join(available_kernels('cuda'))}\n"
    )
    rows: list[Row] = []
    for name, section in SECTIONS.items():
        if name in args.skip:
            continue
        start = time.perf_counter()
        try:
            rows += section()
        except Exception as exc:  # one broken section must not hide the others' numbers
            rows.append(
                Row(
                    name,
                    f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                    math.nan,
                    "-",
                    False,
                )
            )
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print("| section | check | value | limit | ok |")
    print("|---|---|---:|---|---|")
    for r in rows:
        print(f"| {r.section} | {r.check} | {r.value:.3g} | {r.limit} | {'yes' if r.ok else 'NO'} |")
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed")
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
