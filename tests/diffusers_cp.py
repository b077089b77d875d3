"""diffusers' own context parallelism on CPU/gloo: an external reference for our runtime.

`diffusers_cp_latents` spawns `world_size` processes, builds the same tiny Wan in each,
installs diffusers' built-in CP (`transformer.enable_parallelism(config=
ContextParallelConfig(...))`, the model's declarative `_cp_plan`), runs `WanPipeline` and
returns rank 0's final latents. Nothing of ours runs inside the workers except the tiny
model builder, so agreement with it is evidence from outside our code.

diffusers 0.42.1 targets accelerators; two CPU-only patches make it run here, both applied
inside the worker processes only (see `patch_diffusers_for_cpu`):

1. `torch.accelerator.device_count` -> 1. `ModelMixin._resolve_parallel_config` computes
   `rank % torch.accelerator.device_count()`, which is 0 on a CPU-only build:
   ZeroDivisionError. The mesh itself is built with device_type "cpu" and works with gloo.
2. Ring attention only (ring_degree > 1): `TemplatedRingAttention` merges per-chunk partial
   results by their log-sum-exp, so it calls the backend's forward op with
   `return_lse=True`. The "native" backend (the default, and the one the single-process
   pipeline uses) raises "Native attention does not support return_lse=True"; the other
   CP-capable backends need CUDA kernels (flash, cuDNN, sage, ...). The patch answers
   `return_lse=True` with `aten._scaled_dot_product_flash_attention_for_cpu`, which returns
   (out, lse) on CPU; `return_lse=False` still goes to diffusers' own op. Ulysses never asks
   for the lse and runs unpatched apart from (1).

Requirements diffusers imposes (not ours): the video token count (latent frames/p_t *
height/p_h * width/p_w) must be divisible by ring_degree * ulysses_degree
(`EquipartitionSharder.shard` asserts it, unless the `*_anything` modes are used), and
`heads` by ulysses_degree.
"""

from __future__ import annotations

import multiprocessing
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from tiny_wan import TinyWanConfig

# Same sizes as the parity model in conftest.py (deliberately unlike the built-in tiny-wan).
DEFAULT_MODEL_CONFIG = TinyWanConfig(seed=11, heads=2, head_dim=12, layers=3, ffn_dim=40, text_dim=24, text_heads=2)


def patch_diffusers_for_cpu(ring_degree: int) -> None:
    """The CPU-only patches described in the module docstring. Worker processes only."""
    from diffusers.models import attention_dispatch

    # (1) CPU-only torch reports 0 accelerators and diffusers divides by the count.
    torch.accelerator.device_count = lambda *args, **kwargs: 1

    if ring_degree == 1:
        return

    # (2) Give the "native" backend's CP forward op the (out, lse) that ring attention needs.
    original_forward_op = attention_dispatch._native_attention_forward_op

    def native_forward_op_with_lse(
        ctx,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        return_lse=False,
        _save_ctx=True,
        _parallel_config=None,
    ):
        # query/key/value: [B, S, H, D] (diffusers' model layout); out the same, lse [B, S, H] fp32.
        if not return_lse:
            return original_forward_op(
                ctx,
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                return_lse,
                _save_ctx=_save_ctx,
                _parallel_config=_parallel_config,
            )
        if enable_gqa:
            raise ValueError("enable_gqa is not supported by the CPU lse patch")
        # Inference only: nothing is saved on ctx, so a backward through this op would fail loudly.
        out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(x.transpose(1, 2) for x in (query, key, value)),
            dropout_p=dropout_p,
            is_causal=is_causal,
            attn_mask=attn_mask,
            scale=scale,
        )
        return out_BHSD.transpose(1, 2), lse_BHS.transpose(1, 2)

    # `_native_attention` looks the op up as a module global at call time.
    attention_dispatch._native_attention_forward_op = native_forward_op_with_lse


def _worker(
    rank: int,
    world_size: int,
    workdir: str,
    ring_degree: int,
    ulysses_degree: int,
    gen_kwargs_bytes: bytes,
    model_config: TinyWanConfig,
    timeout_s: float,
) -> None:
    """One rank: build, parallelize, generate, save latents; on failure save the traceback."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        patch_diffusers_for_cpu(ring_degree)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        from diffusers import ContextParallelConfig, WanPipeline

        from tiny_wan import build_tiny_wan

        components = build_tiny_wan(model_config)
        components["transformer"].enable_parallelism(
            config=ContextParallelConfig(ring_degree=ring_degree, ulysses_degree=ulysses_degree)
        )
        pipe = WanPipeline(**components)
        pipe.set_progress_bar_config(disable=True)
        gen_kwargs = pickle.loads(gen_kwargs_bytes)
        latents = pipe(**gen_kwargs, output_type="latent").frames
        torch.save(latents, Path(workdir) / f"latents_{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(workdir) / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise


def diffusers_cp_latents(
    world_size: int,
    ring_degree: int,
    ulysses_degree: int,
    gen_kwargs: dict,
    model_config: TinyWanConfig | None = None,
    timeout_s: float = 60,
) -> torch.Tensor:
    """Final latents of `WanPipeline(**gen_kwargs)` under diffusers' context parallelism.

    gen_kwargs: keyword arguments of `WanPipeline.__call__` (picklable; a CPU
    `torch.Generator` is fine, its state travels); `output_type` is forced to "latent".
    Returns rank 0's latents, float32 [B, C, F, H, W] (latent frames/height/width).
    Raises RuntimeError with the workers' tracebacks if any rank fails or if ranks disagree,
    and TimeoutError (after terminating every rank) if they do not finish in
    `timeout_s` plus a start-up allowance.
    """
    if ring_degree < 1 or ulysses_degree < 1 or ring_degree * ulysses_degree > world_size:
        # Checked again by diffusers inside the workers; failing here is cheaper.
        raise ValueError(
            f"need 1 <= ring_degree * ulysses_degree <= world_size, got ring_degree={ring_degree}, "
            f"ulysses_degree={ulysses_degree}, world_size={world_size}"
        )
    model_config = model_config or DEFAULT_MODEL_CONFIG
    # Spawn start-up (a fresh interpreter importing torch + diffusers) is not covered by the
    # process-group timeout, so the deadline allows for it on top.
    deadline = time.monotonic() + timeout_s + 60
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="diffusers_cp_") as workdir:
        # Pre-pickled with the plain pickler: multiprocessing's pickler (with torch's reductions)
        # would send tensors, e.g. a Generator's state, through shared memory, which fails in
        # containers with a small /dev/shm ("unable to resize file ... Invalid argument").
        gen_kwargs_bytes = pickle.dumps(gen_kwargs)
        args = (world_size, workdir, ring_degree, ulysses_degree, gen_kwargs_bytes, model_config, timeout_s)
        procs = [ctx.Process(target=_worker, args=(rank, *args), daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            while any(p.is_alive() for p in procs):
                # A failed rank may leave the others blocked in a collective: stop at once.
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"diffusers CP workers did not finish within {timeout_s} s (+60 s start-up)")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()

        errors = sorted(Path(workdir).glob("error_*.txt"))
        failed = [rank for rank, p in enumerate(procs) if p.exitcode != 0]
        if errors or failed:
            details = "\n".join(f"--- {e.stem} ---\n{e.read_text()}" for e in errors)
            details = details or "(no traceback file: a rank died before or outside _worker; see stderr)"
            raise RuntimeError(f"diffusers CP worker(s) failed (exit codes {[p.exitcode for p in procs]}):\n{details}")

        latents = [torch.load(Path(workdir) / f"latents_{rank}.pt") for rank in range(world_size)]
    # After proj_out's gather every rank holds the full output and steps the same scheduler.
    for rank, other in enumerate(latents[1:], start=1):
        if not torch.equal(latents[0], other):
            diff = (latents[0] - other).abs().max().item()
            raise RuntimeError(f"rank {rank} latents differ from rank 0 by {diff}")
    return latents[0]
