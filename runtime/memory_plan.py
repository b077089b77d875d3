"""A run's memory, decided before its ranks start: the GPU pre-flight (offloads, or what would
make the run fit) for every item size, the host memory a node's ranks need (a submission's
--mem), and how many CPU ranks this machine can hold (planner/memory.py and
planner/host_memory.py price them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from basics.errors import ConfigError
from planner.models import VideoSize
from runtime.config import RunConfig


def plan_memory(cfg: RunConfig, shape, gpu_bytes: int, dtype_bytes: int, what: str) -> RunConfig:
    """The memory pre-flight (planner/memory.py) of every item size of `cfg` on GPUs of
    `gpu_bytes`: a ConfigError naming what would make it fit when it cannot; else `cfg` with
    the offloads it needs (none when everything fits)."""
    from planner.preflight import preflight

    offload: set[str] = set()
    for size, options in item_memory_options(cfg, dtype_bytes):
        where = f"{what} {size.width}x{size.height}x{size.frames} on {cfg.layout.world_size} GPU(s) per replica"
        fitted = preflight(shape, cfg.layout, size, options, gpu_bytes, where)
        offload |= {"text_encoder"} if fitted.offload_text_encoder else set()
        offload |= {"transformer"} if fitted.offload_transformer else set()
    return replace(cfg, offload=tuple(sorted(offload)), gpu_memory=gpu_bytes)


def item_memory_options(cfg: RunConfig, dtype_bytes: int):
    """(VideoSize, MemoryOptions) of each distinct item size and guidance of `cfg`."""
    from planner.memory import MemoryOptions, cfg_branches

    cache_bytes = 4 if cfg.ditango is not None and cfg.ditango.cache_dtype == "float32" else 2
    planner = cfg.ditango.planner if cfg.ditango is not None else None
    ditango = {"own_group": planner.own_group, "planner": planner.planner} if planner is not None else {}
    for h, w, f, scale in sorted({(i.height, i.width, i.frames, i.cfg_scale) for i in cfg.items}):
        options = MemoryOptions(
            dtype_bytes=dtype_bytes,
            shard_weights=cfg.shard_weights,
            hybrid=cfg.hybrid is not None,
            cfg_branches_per_rank=cfg_branches(scale, cfg.layout.cfg_degree),
            cache_bytes=cache_bytes,
            vae_tiling=cfg.decode.tiled,
            vae_parallel=cfg.decode.parallel,
            tile_px=cfg.decode.tile_px or 256,
            quantize=cfg.quantize,
            **ditango,
        )
        yield VideoSize(h, w, f), options


# A CPU rank before its model: the interpreter, torch, diffusers and gloo (369 MiB measured with
# the CPU wheel), with room for the allocator and the video encoder.
RANK_BASE_BYTES = 512 * 2**20


def available_host_memory() -> int | None:
    """This machine's available memory (MemAvailable, Linux), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_local_cpu_ranks(cfg: RunConfig, shape, dtype_bytes: int) -> None:
    """Local ranks on CPUs each hold the whole pipeline in this machine's memory: refuse more of
    them than its available memory holds (the memory model's peak of a rank, plus a rank's
    base), naming how many it can, instead of starting processes the kernel would kill."""
    from planner.memory import GIB, estimate_memory

    available = available_host_memory()
    if available is None:
        return
    peak = max(
        estimate_memory(shape, cfg.layout, size, o).peak_bytes for size, o in item_memory_options(cfg, dtype_bytes)
    )
    per_rank = RANK_BASE_BYTES + peak
    fits, n = available // per_rank, cfg.world_size
    if n <= fits:
        return
    need = (
        f"{n} local rank(s) on CPUs need about {n * per_rank / GIB:.1f} GiB of memory ({per_rank / GIB:.2f} GiB each)"
    )
    if fits == 0:
        raise ConfigError(
            f"{need}; this machine has {available / GIB:.1f} GiB available: run on GPUs, or on a "
            "machine with more memory"
        )
    raise ConfigError(
        f"{need}; this machine has {available / GIB:.1f} GiB available, enough for {fits}: use at "
        f"most {fits} ranks in all (--nodes x --gpus-per-node x --replicas), or run on GPUs"
    )


def memory_preflight(cfg: RunConfig, shape, gpu_memory: str | None, placement, local: bool, dtype_given: bool):
    """`plan_memory` against `--gpu-memory` (a size), else this machine's GPU for a local CUDA
    run; neither: `cfg` as it is (the ranks then check against their own GPUs). The element
    size is the run's dtype on a GPU (bfloat16 unless --dtype says otherwise)."""
    import torch

    from planner.memory import parse_bytes

    gpu_bytes = None if gpu_memory is None else parse_bytes(gpu_memory, "--gpu-memory")
    if gpu_bytes is not None and gpu_bytes < 2**31:
        raise ConfigError(f"--gpu-memory {gpu_memory}: below 2 GiB, less than the runtime itself needs")
    if gpu_bytes is None and placement.device.type == "cuda" and local:
        gpu_bytes = torch.cuda.get_device_properties(placement.device).total_memory
    if gpu_bytes is None:
        return cfg
    element = placement.dtype.itemsize if dtype_given or placement.device.type == "cuda" else 2
    return plan_memory(cfg, shape, gpu_bytes, element, cfg.model)


def plan_host_memory(cfg: RunConfig, shape, dtype_bytes: int) -> RunConfig:
    """`cfg` with the host bytes per node its ranks need (planner/host_memory.py), the largest
    over its item sizes, with the offloads the pre-flight chose."""
    from planner.host_memory import host_memory
    from planner.memory import estimate_memory

    on_gpu, per_node = cfg.device == "cuda", 0
    offload = {f"offload_{name}": name in cfg.offload for name in ("text_encoder", "transformer")}
    for size, options in item_memory_options(cfg, dtype_bytes):
        options = replace(options, **offload)
        peak = 0 if on_gpu else estimate_memory(shape, cfg.layout, size, options).peak_bytes
        estimate = host_memory(shape, cfg.layout, options, cfg.gpus_per_node, on_gpu, peak)
        per_node = max(per_node, estimate.per_node)
    return replace(cfg, host_memory=per_node)
