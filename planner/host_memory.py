"""Host memory of a rank and of a node: what a Slurm job asks for (--mem), beside the CPUs.

What one rank holds in host memory (runtime/models/loading.py reads every component straight
into its dtype onto its device, meta-device init, from the mapped safetensors files):
  base      the process: the interpreter, torch, diffusers, gloo; on a GPU also torch's CUDA
            libraries and the CUDA context's host side (`RANK_BASE_*`);
  load      the components loaded onto the CPU first, whole, in the run's dtype: with
            --shard-weights the transformers and the text encoders (runtime/weights.py shards
            them, then moves the shards), with tensor parallelism the transformers (each rank
            cuts its slices there, runtime/assembly.py), with --quantize the transformers
            (each layer is quantized as it moves to the GPU, runtime/quantize.py); and the
            file being read (`file_transient`:
            the largest component's file, at most one shard of `SHARD_BYTES`, float32 on disk);
  run       the components the GPU pre-flight offloads to the CPU (planner/preflight.py):
            the text encoders after encoding, the transformers before the decode (with
            --quantize fp8 as quantized: planner/precision.py; the load reads them in the run's
            dtype before quantizing, so the load stays counted at it);
  CPU rank  the device is the host: the memory model's whole peak (planner/memory.py).
Per rank: base + max(load, run). Per node: the ranks on it x per rank, with
`HOST_HEADROOM_FRACTION` for what is not modelled (allocator, pinned staging buffers, the video
encoder) and `NODE_RESERVE_BYTES` for the launcher and the job's own processes.

The files' mapped pages are page cache, shared by the ranks of a node that read the same file
and reclaimable; they are counted per rank all the same (ranks read different shards at
different moments, and the job's memory cgroup charges page cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from basics.errors import ConfigError
from planner.layout import ParallelLayout
from planner.memory import F32, GIB, MemoryOptions
from planner.models import ModelShape
from planner.precision import transformer_bytes

# A CPU rank before its model (the CPU wheel: 369 MiB measured; runtime/config.py says the same).
RANK_BASE_CPU_BYTES = 512 * 2**20
# A GPU rank: torch's CUDA libraries (cuBLAS, cuDNN, NCCL: about 1.5 GiB of mapped code) and the
# CUDA context's host side. An estimate, not measured here (no GPU in the CPU suite).
RANK_BASE_GPU_BYTES = 3 * GIB
# diffusers' save_pretrained(max_shard_size="10GB"): the largest file a checkpoint is cut into.
SHARD_BYTES = 10 * 10**9
HOST_HEADROOM_FRACTION = 0.10
NODE_RESERVE_BYTES = 4 * GIB
# CPU threads per rank: the Python thread launching kernels, NCCL's proxy and gloo's threads,
# the safetensors reads, the tokenizer and the video encoder; torch's intra-op pool for the
# CPU-side work. 8 per rank fills 64 of a node's cores at 8 GPUs per node, within what GPU
# nodes have (DGX H100: 112 cores; most clusters give 8-16 per GPU).
CPUS_PER_RANK = 8


@dataclass(frozen=True)
class HostEstimate:
    """Host bytes of one rank (`parts`: base, load, file_transient, run, device_peak) and of a
    node of `ranks_per_node` ranks."""

    parts: dict[str, int]
    ranks_per_node: int

    @property
    def per_rank(self) -> int:
        p = self.parts
        return p["base"] + p["device_peak"] + max(p["load"] + p["file_transient"], p["run"])

    @property
    def per_node(self) -> int:
        return math.ceil(self.ranks_per_node * self.per_rank * (1 + HOST_HEADROOM_FRACTION)) + NODE_RESERVE_BYTES

    @property
    def mem_request(self) -> str:
        return mem_request(self.per_node)


def mem_request(per_node: int) -> str:
    """sbatch's --mem for a node of `per_node` bytes: whole GiB, rounded up ("113G")."""
    return f"{math.ceil(per_node / GIB)}G"


def host_memory(
    shape: ModelShape,
    layout: ParallelLayout,
    options: MemoryOptions,
    ranks_per_node: int,
    on_gpu: bool,
    device_peak: int = 0,
) -> HostEstimate:
    """The host memory of a rank of `layout` computing on a GPU (`on_gpu`) or on the CPU, whose
    peak on its device (`device_peak`: planner/memory.py's `estimate_memory`) is then host
    memory too. `options.dtype_bytes` is the run's dtype."""
    if ranks_per_node < 1:
        raise ConfigError(f"host memory: ranks per node must be >= 1, got {ranks_per_node}")
    e = options.dtype_bytes
    transformer, text = shape.params * e, shape.text_encoder_params * e
    held = transformer_bytes(shape, e, options.quantize)  # what an offloaded transformer holds (fp8: quantized)
    vae = shape.vae.params if shape.vae is not None else 0
    largest = max(shape.params, shape.text_encoder_params, vae, shape.image_encoder_params)
    parts = {
        "base": RANK_BASE_GPU_BYTES if on_gpu else RANK_BASE_CPU_BYTES,
        "file_transient": min(largest * F32, SHARD_BYTES),
        "load": 0,
        "run": 0,
        "device_peak": 0,
    }
    if not on_gpu:
        parts["device_peak"] = device_peak
        return HostEstimate(parts, ranks_per_node)
    if layout.world_size > 1 and options.shard_weights:
        parts["load"] = transformer + text
    elif (layout.world_size > 1 and layout.strategy.splits_weights) or options.quantize != "none":
        parts["load"] = transformer
    if not options.shard_weights:  # sharded modules stay where FSDP put them
        parts["run"] = text * options.offload_text_encoder + held * options.offload_transformer
    return HostEstimate(parts, ranks_per_node)
