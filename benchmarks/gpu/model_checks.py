"""Sections 6 and 7 of benchmarks/gpu_check.py: FSDP2 and DTensor tensor parallelism on a
one-rank mesh (the runtime skips both on one rank), and the memory model against the
allocator's peak for one Wan2.1-14B-width block at real sequence length and a Wan VAE decode.
Each takes a device (and backend), so the CPU suite runs them at small sizes over gloo, the
peak there traced by torch's MemTracker (tests/test_gpu_check.py)."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch

from benchmarks.gpu.runtime_checks import Row, _rand

# Two blocks of Wan2.1-1.3B's width (12 heads x 128): enough for every split, seconds on a GPU.
WAN_SMALL = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)


def _one_rank_world(device: torch.device, backend: str) -> None:
    import torch.distributed as dist

    bound = {"device_id": device} if device.type == "cuda" else {}
    rdzv = tempfile.mktemp(prefix="ditango-gpu-check-")
    dist.init_process_group(
        backend, init_method=f"file://{rdzv}", rank=0, world_size=1, timeout=timedelta(seconds=60), **bound
    )


def sharding_rows(
    device: str = "cuda",
    backend: str = "nccl",
    config: dict | None = None,
    latent_shape=(3, 16, 16),
    dtype: torch.dtype | None = None,
    text_len: int = 64,
) -> list[Row]:
    """A random-weight Wan transformer's forward three ways on one rank: whole, FSDP2-sharded
    (runtime/weights.py, `min_degree` 1) and split by DTensor tensor parallelism (wan.install_tp
    with `split_one`); each must equal the whole one, and every TP shard must own only its bytes."""
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel
    from torch.distributed.tensor import DTensor

    from planner.layout import ParallelLayout
    from runtime.comm import Comm
    from runtime.kernels import resolve_backend
    from runtime.mesh import build_mesh
    from runtime.models import wan
    from runtime.models.meta import cast_like_loader
    from runtime.strategies.tensor import TensorParallel
    from runtime.weights import shard_weights

    config = config or WAN_SMALL
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _one_rank_world(dev, backend)
    rows = []
    try:
        torch.manual_seed(0)
        with torch.device(dev):
            model = WanTransformer3DModel(**config)
        cast_like_loader(model, dtype)
        model.eval().requires_grad_(False)
        g = torch.Generator(device=dev).manual_seed(1)
        F, H, W = latent_shape
        latents = _rand((1, config["in_channels"], F, H, W), dtype, dev, g)
        text = _rand((1, text_len, config["text_dim"]), dtype, dev, g)
        t = torch.tensor([500.0], device=dev)

        def forward(m) -> torch.Tensor:
            with torch.no_grad():
                return m(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0].float()

        ref = forward(model)

        def rel(x: torch.Tensor) -> float:
            return ((x - ref).norm() / ref.norm()).item()

        sharded = copy.deepcopy(model)
        mesh = build_mesh(ParallelLayout(), 0, (0,), device=dev)
        degree = shard_weights({"transformer": sharded}, mesh, dev, min_degree=1)
        fsdp = type(sharded).__name__.startswith("FSDP")
        r = rel(forward(sharded))
        rows.append(
            Row(
                "sharding",
                f"FSDP2 over a one-rank mesh (degree {degree}): forward vs whole (relative)",
                r,
                f"<= {tol:g}",
                fsdp and r <= tol,
            )
        )

        split = copy.deepcopy(model)
        tp_mesh = build_mesh(ParallelLayout(strategy="tp"), 0, (0,), device=dev)
        tp = TensorParallel(tp_mesh, Comm(tp_mesh), resolve_backend("auto", dev, dtype), split_one=True)
        wan.install_tp(split, tp)
        dtensors = [p for p in split.parameters() if isinstance(p, DTensor)]
        r = rel(forward(split))
        rows.append(
            Row(
                "sharding",
                f"DTensor TP over a one-rank mesh ({len(dtensors)} split parameters): forward vs whole (relative)",
                r,
                f"<= {tol:g}",
                bool(dtensors) and r <= tol,
            )
        )
        extra = sum(p.to_local().untyped_storage().nbytes() - p.to_local().numel() * p.element_size() for p in dtensors)
        rows.append(Row("sharding", "TP shards: storage bytes beyond their own", extra, "== 0", extra == 0))
    finally:
        dist.destroy_process_group()
    return rows


def _peak_cuda(device: torch.device) -> Callable:
    def measure(fn) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    return measure


def _peak_traced(device: torch.device) -> Callable:
    """The CPU suite's stand-in for the allocator's peak: torch's MemTracker over `fn`."""
    from runtime.rehearse import inference_tracker

    def measure(fn) -> int:
        tracker = inference_tracker()
        with tracker:
            base = tracker.get_tracker_snapshot().get(device, {}).get("Total", 0)
            fn()
        return tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0) - base

    return measure


def memory_rows(
    device: str = "cuda",
    heads: int = 40,
    head_dim: int = 128,
    ffn: int = 13824,
    tokens: int = 75_600,
    text_len: int = 512,
    video: tuple[int, int, int] = (720, 1280, 81),
    tol: float = 0.15,
) -> list[Row]:
    """planner/memory.py against the measured peak: one Wan block (Wan2.1-14B's width by default)
    at `tokens` in bfloat16 on GPU (the block's transient: `block_bytes` less the forward's
    full-length inputs), and a random-weight Wan2.1 VAE decode of `video` (height, width,
    frames), untiled and in diffusers' 256-pixel tiles (`decode_bytes`)."""
    from diffusers import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from planner.decode_memory import decode_bytes
    from planner.layout import ParallelLayout
    from planner.memory import MemoryOptions, block_bytes, forward_inputs_bytes
    from runtime.models.meta import cast_like_loader
    from runtime.models.registry import REGISTRY

    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    peak = _peak_cuda(dev) if dev.type == "cuda" else _peak_traced(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e = dtype.itemsize
    C = heads * head_dim
    rows = []
    torch.manual_seed(0)
    with torch.device(dev):
        block = WanTransformerBlock(C, ffn, heads, "rms_norm_across_heads", True, 1e-6)
    cast_like_loader(block, dtype)
    block.eval().requires_grad_(False)
    g = torch.Generator(device=dev).manual_seed(1)
    x = _rand((1, tokens, C), dtype, dev, g)
    text = _rand((1, text_len, C), dtype, dev, g)
    temb = _rand((1, 6, C), torch.float32, dev, g)
    cos = torch.ones(1, tokens, 1, head_dim, device=dev)
    sin = torch.zeros(1, tokens, 1, head_dim, device=dev)
    with torch.no_grad():
        got = peak(lambda: block(x, text, temb, (cos, sin)))
    block = x = text = None  # their memory back before the decode
    shape = replace(REGISTRY["wan2.1-14b"].shape, heads=heads, head_dim=head_dim, ffn=ffn, text_len=text_len)
    _, _, transient = block_bytes(shape, ParallelLayout(), tokens, MemoryOptions(dtype_bytes=e))
    model = transient - forward_inputs_bytes(shape, tokens, e)  # the inputs exist before the measurement
    ratio = got / model
    rows.append(
        Row(
            "memory",
            f"one block C={C} F={ffn} at {tokens} tokens ({str(dtype)[6:]}): peak / model "
            f"({got / 2**30:.2f} / {model / 2**30:.2f} GiB)",
            ratio,
            f"within {tol:.0%}",
            abs(ratio - 1) <= tol,
        )
    )
    h, w, f = video
    with torch.device(dev):
        vae = AutoencoderKLWan()
    vae.eval().requires_grad_(False)
    vae_shape = REGISTRY["wan2.1-14b"].shape.vae
    latent = ((f - 1) // 4 + 1, h // 8, w // 8)
    z = _rand((1, 16, *latent), torch.float32, dev, g)
    for tiled in (False, True):
        if tiled:
            vae.enable_tiling()
        else:
            vae.disable_tiling()
        with torch.no_grad():
            got = peak(lambda: vae.decode(z, return_dict=False)[0])
        model = decode_bytes(vae_shape, latent, tiled, 256)
        ratio = got / model
        rows.append(
            Row(
                "memory",
                f"Wan VAE decode {w}x{h}x{f} {'tiled 256 px' if tiled else 'untiled'}: peak / model "
                f"({got / 2**30:.2f} / {model / 2**30:.2f} GiB)",
                ratio,
                f"within {tol:.0%}",
                abs(ratio - 1) <= tol,
            )
        )
    return rows
