"""`--shard-weights`: the transformer(s) and the text encoder sharded over the ranks, by
PyTorch's FSDP2 (`fully_shard`), for inference.

Each block of a model's block stack is its own FSDP unit (its parameters all-gathered just
before its forward and freed after it), the rest of the model the root unit. The shards go
over the cp group: its ranks run the same blocks at the same time under every strategy
(ring, Ulysses, USP, DiTango, and each CFG branch's group under CFG-parallel), which FSDP's
collectives need. Hybridiff's segments run different blocks on the two branch groups, and
call blocks outside the model's forward, so it is not combined with sharding (refused at
configuration). The float32 modules diffusers keeps in a bfloat16 model (norms, the time
embedding, modulation tables) stay whole on every rank: FSDP wants one dtype per unit, and
they are a small share of the weights.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from runtime.mesh import Mesh

SHARDED = ("transformer", "transformer_2", "text_encoder")


def shard_weights(components: dict, mesh: Mesh, device: torch.device, min_degree: int = 2) -> int:
    """Shard `components`' transformers and text encoder over `mesh`'s cp group in place;
    return the shard degree (1: a single rank, nothing sharded). Modules end on `device`.
    `min_degree` 1: FSDP over a one-rank group too (the GPU check runs FSDP on one GPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    degree = mesh.layout.cp_degree
    if degree < min_degree or (mesh.cp_group is None and degree > 1):
        return 1
    dmesh = DeviceMesh.from_group(mesh.cp_group or dist.group.WORLD, device.type)
    for name in SHARDED:
        module = components.get(name)
        if module is None:
            continue
        dtype = _main_dtype(module)
        whole = {p for p in module.parameters() if p.dtype != dtype}
        for block in block_stacks(module):
            fully_shard(block, mesh=dmesh, ignored_params={p for p in block.parameters() if p in whole})
        with _outputs_recorded(module):
            fully_shard(module, mesh=dmesh, ignored_params=whole)
        module.to(device)
    return degree


@contextlib.contextmanager
def _outputs_recorded(module: nn.Module):
    """Keep a transformers model's `output_hidden_states` through FSDP2's class swap: transformers
    (5.x) looks up which layer outputs a model records by the name of its class, and
    `fully_shard` gives the module a new class (FSDP<Name>), under which it records nothing:
    `hidden_states` came back None (HunyuanVideo-1.5's Qwen, HunyuanVideo's Llama: the pipelines
    read a hidden state before the last). The new class is registered with the old one's."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:  # another transformers: nothing keyed by class
        registry = None
    flags = None if registry is None else registry.get(module)
    yield
    if flags:
        registry[module] = flags


def block_stacks(module: nn.Module) -> list[nn.Module]:
    """The blocks of every outermost ModuleList of `module` (Wan's `blocks`, HunyuanVideo's two
    stacks, UMT5's `encoder.block`, Llama's `layers`): one FSDP unit each."""
    stacks: list[tuple[str, nn.ModuleList]] = []
    for name, child in module.named_modules():
        inside = any(name.startswith(f"{prefix}.") for prefix, _ in stacks)
        if isinstance(child, nn.ModuleList) and len(child) > 1 and not inside:
            stacks.append((name, child))
    return [block for _, stack in stacks for block in stack if any(True for _ in block.parameters())]


def move_unsplit(module: nn.Module, device: torch.device) -> None:
    """Move what a split left whole (plain parameters and buffers) to `device`; the DTensor
    parameters tensor parallelism made are there already."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if not isinstance(tensor, DTensor) and tensor.device != device:
                tensor.data = tensor.data.to(device)


def move_module(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)`: the move `place` makes (a rehearsal makes it on fake tensors)."""
    module.to(device)


def place(modules: list[nn.Module], device: torch.device) -> None:
    """Move whole modules (not sharded ones) to `device` when they are elsewhere: the offload
    of a component a stage does not need when memory is short (RunConfig.offload)."""
    moved = False
    for module in modules:
        first = next(module.parameters(), None)
        if first is not None and first.device != device and not hasattr(module, "unshard"):
            move_module(module, device)
            moved = True
    if moved and device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the allocator gives the freed blocks back to the GPU


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards, and what stays whole)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _main_dtype(module: nn.Module) -> torch.dtype:
    """The dtype most of the module's parameter bytes have."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in module.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    return max(by_dtype, key=by_dtype.get)
