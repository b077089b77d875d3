"""Section 8 of benchmarks/gpu_check.py: `--compile` (runtime/compile.py) on a random-weight
Wan transformer of Wan2.1-1.3B's width (2 blocks) with the ring strategy installed over one
rank, so every block runs our processor through the `ditango::` custom ops: the compiled
forward against the eager one (relative L2 and max abs error), no graph break, no fallback,
one graph for every block, and the time per forward (median after warm-up).

Takes a device and torch.compile's backend, so the CPU suite runs it on a tiny model with
dynamo's "eager" backend (tracing only: the graph breaks are dynamo's; tests/test_gpu_check.py).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.gpu.model_checks import WAN_SMALL
from benchmarks.gpu.runtime_checks import Row, random_wan


def median_s(fn: Callable[[], object], device: str, reps: int = 5, warmup: int = 2) -> float:
    """Seconds per call of `fn`: the median of `reps` calls after `warmup`; each call timed by
    CUDA events on a GPU (the kernels' time, not the launch's), by the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max abs error) of `got` against `ref`, in float32."""
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm()).item(), (got - ref).abs().max().item()


def compile_rows(
    device: str = "cuda",
    config: dict | None = None,
    latent_shape: tuple[int, int, int] = (21, 30, 52),  # 8,190 tokens
    dtype: torch.dtype = torch.bfloat16,
    text_len: int = 512,
    backend: str = "inductor",
    rel_tol: float = 2e-2,
    reps: int = 5,
) -> list[Row]:
    """Eager against compiled forwards of one transformer, same weights and inputs."""
    from torch._dynamo.utils import counters

    from planner.layout import ParallelLayout
    from runtime.comm import Comm
    from runtime.compile import CompileRecord, compile_blocks, uncompile_blocks
    from runtime.kernels import resolve_backend
    from runtime.mesh import build_mesh
    from runtime.strategies import parallelize

    model, forward = random_wan(config or WAN_SMALL, latent_shape, text_len, dtype, device)

    attention = resolve_backend("auto", torch.device(device), dtype)
    mesh = build_mesh(ParallelLayout(strategy="ring"), 0, (0,), device=torch.device(device))
    handles = parallelize(model, mesh, Comm(mesh), attention)
    try:
        eager = forward().float()
        eager_s = median_s(forward, device, reps)
        counters.clear()
        torch._dynamo.reset()
        record = compile_blocks([model], CompileRecord(), backend=backend)
        started = time.perf_counter()
        compiled = forward().float()  # the compile, and the result
        first_s = time.perf_counter() - started
        compiled_s = median_s(forward, device, reps)
        uncompile_blocks([model])
    finally:
        handles.remove()
    breaks = sum(counters["graph_break"].values())
    reasons = "; ".join(str(k)[:120] for k in list(counters["graph_break"])[:2])
    graphs = counters["stats"]["unique_graphs"]
    rel, max_abs = errors(compiled, eager)
    tokens = math.prod(n // p for n, p in zip(latent_shape, model.config.patch_size, strict=True))
    name = f"{config['num_layers']} blocks, {tokens} tokens, ring over one rank ({attention}), {backend}"
    ratio = compiled_s / eager_s
    fast = device == "cuda" and backend == "inductor"  # a speed limit only where inductor runs kernels
    return [
        Row(
            "compile",
            f"{name}: graph breaks{f' ({reasons})' if reasons else ''}, fallback {record.fallback}",
            float(breaks),
            "0, no fallback",
            breaks == 0 and record.fallback is None,
        ),
        Row(
            "compile",
            f"{name}: graphs for {record.blocks} blocks (not one per block)",
            float(graphs),
            "1..2",
            1 <= graphs <= 2 and record.blocks == config["num_layers"],
        ),
        Row(
            "compile",
            f"{name}: compiled vs eager, relative L2 (max abs {max_abs:.3g})",
            rel,
            f"<= {rel_tol:g}",
            rel <= rel_tol and bool(torch.isfinite(compiled).all()),
        ),
        Row(
            "compile",
            f"{name}: time per forward, eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms "
            f"(ratio; first call {first_s:.1f} s)",
            ratio,
            "<= 1" if fast else "-",
            ratio <= 1 if fast else not math.isnan(ratio),
        ),
    ]
