"""Single-GPU acceptance checks: numbers with limits, not only "an MP4 appeared".

    python benchmarks/gpu_check.py [--skip generate] [--json out.json]

On one CUDA GPU (sized for a few minutes on an H200; the budget is 10). Needs the project's
dependencies (diffusers, transformers, submitit, imageio, imageio-ffmpeg; flash-attn when
installed). Prints one markdown table and exits 1 when any row fails. Sections:

1. kernels: every attention backend (torch's fused kernels; flash-attn when it imports) in
   bf16, fp16 and fp32 (flash: no fp32 kernel), head dims 48 and 128, on odd lengths, a
   1-token query and a 1-token key block, and permuted (non-contiguous) strides: the
   state's lse is [B, S, H] float32 and finite, out and lse match float64, and merging the
   states of an uneven split of the keys equals one-shot attention;
2. nccl: a one-rank NCCL world (device bound) and a hand-built mesh whose ring members are
   all this rank: the real `Comm` (P2P to itself, gather), ring attention and the DiTango
   runtime (fetch, cache, reuse, plan check) run over NCCL; with every member holding the
   same KV, attention over k copies equals attention over one, lse + log k;
3. processor: Wan2.1-1.3B geometry (12 heads x 128, 30 layers) with random weights at
   832x480x81 (32,760 tokens) in bf16: our context-parallel processor (one rank) against
   diffusers' own, relative difference, time per forward and peak memory;
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
   1280x720x81, untiled and tiled.

Sections 2 and 4 are in benchmarks/gpu/runtime_checks.py, 6 and 7 in benchmarks/gpu/model_checks.py.
The CPU suite runs sections 1, 3, 4, 6 and 7 on the CPU at small sizes (7's peak traced by torch's
MemTracker), and section 2's bring-up and collectives over gloo (tests/test_gpu_check.py);
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

from benchmarks.gpu.model_checks import memory_rows, sharding_rows  # noqa: E402
from benchmarks.gpu.runtime_checks import Row, _rand, cache_rows, nccl_rows  # noqa: E402
from runtime.kernels import attention, flash_attn_available, reference_attention  # noqa: E402
from runtime.state import merge_all  # noqa: E402

GENERATE_TIMEOUT_S = 300  # one built-in-model run takes seconds on a GPU; a hang fails its row
# Max abs error of out against float64, per compute dtype (inputs ~ N(0, 1)).
OUT_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LSE_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


# -- 1. kernels -------------------------------------------------------------------------------
def kernel_rows(
    device: str = "cuda",
    backends: list[str] | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32),
    head_dims: tuple[int, ...] = (48, 128),
    lengths: tuple[int, int] = (333, 1000),
) -> list[Row]:
    """The attention-state contract of every backend (see the module docstring)."""
    if backends is None:
        backends = ["torch"] + (["flash"] if device == "cuda" and flash_attn_available() else [])
    g = torch.Generator(device=device).manual_seed(0)
    S, K = lengths
    B, H = 2, 3
    rows = []
    for backend in backends:
        for dtype in dtypes:
            if backend == "flash" and dtype == torch.float32:
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
    return [
        Row("kernels", f"{name}: lse [B,S,H] float32, finite", float(contract), "1", contract),
        Row("kernels", f"{name}: out vs float64", out_err, f"<= {tol:g}", out_err <= tol),
        Row("kernels", f"{name}: lse vs float64", lse_err, f"<= {lse_tol:g}", lse_err <= lse_tol),
        Row(
            "kernels",
            f"{name}: merge of {len(parts)} uneven splits vs one-shot (out, lse)",
            max(merge_err, merge_lse_err),
            f"<= {tol:g}",
            merge_err <= tol and merge_lse_err <= lse_tol,
        ),
    ]


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


def _cast_like_from_pretrained(model, dtype: torch.dtype):
    """`dtype`, except the parameters diffusers keeps in float32 when loading (norms, time
    embedding); buffers (the rotary tables) as the class made them, never through `dtype`
    (runtime/models/meta.py `cast_like_loader`, what `from_pretrained(torch_dtype=dtype)` leaves)."""
    from runtime.models.meta import cast_like_loader

    cast_like_loader(model, dtype)
    return model


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
    from diffusers import WanTransformer3DModel

    from planner.layout import ParallelLayout
    from runtime.comm import Comm
    from runtime.kernels import resolve_backend
    from runtime.mesh import build_mesh
    from runtime.strategies import parallelize

    config = config or WAN_1_3B
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    model = _cast_like_from_pretrained(model, dtype).eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(2)
    F, Hl, Wl = latent_shape
    latents = _rand((1, config["in_channels"], F, Hl, Wl), dtype, device, g)
    text = _rand((1, text_len, config["text_dim"]), dtype, device, g)
    t = torch.tensor([500.0], device=device)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

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
    backend = resolve_backend("auto", torch.device(device), dtype)
    mesh = build_mesh(ParallelLayout(strategy="ring"), 0, (0,), device=torch.device(device))
    handles = parallelize(model, mesh, Comm(mesh), backend)
    installed = all(type(b.attn1.processor).__name__ == "WanSelfAttention" for b in model.blocks)
    ours, ours_s, ours_peak = measure()
    handles.remove()
    rel = ((ours - ref).norm() / ref.norm()).item()
    tokens = F * (Hl // 2) * (Wl // 2)
    rows = [
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
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", action="append", default=[], choices=list(SECTIONS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU-checkable parts run in tests/test_gpu_check.py)")
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flash-attn: {flash_attn_available()}\n")
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
