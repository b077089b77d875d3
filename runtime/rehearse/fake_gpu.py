"""A fake GPU for a rehearsed rank (runtime/rehearse/): torch.cuda's queries answered for
the layout's node, a device guard that does nothing, SDPA as the GPU kernels take it, modules
moved as fake tensors, and torch's memory tracker for the phases."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from unittest import mock

import torch

from basics.errors import ConfigError

# Host tensors this small carry their values through the fake mode (torch's limit is 1 element):
# a replayed DiTango plan [layers, units] is read on the host every layer.
CONSTANT_LIMIT = 1 << 16
aten = torch.ops.aten


@contextlib.contextmanager
def cuda_device_guard():
    """A CUDA device guard that does nothing, for as long as the rehearsal runs. torch's CPU
    build registers none, and C++ takes one before indexing, .contiguous(), int() and others of
    a CUDA tensor (fake or not): "not linked with support for cuda devices". The meta device's
    guard (a no-op) stands in, through c10's exported registry (what torch's own
    `_ensureCUDADeviceGuardSet` does for a CUDA build without a GPU). A CUDA build keeps its own."""
    import ctypes

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        registry = (ctypes.c_void_p * 32).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
        register = lib._ZN3c104impl19registerDeviceGuardENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterfaceE
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"ditango rehearse: this torch build's libc10 does not offer its device guard registry "
            f"({exc}); rehearse with a Linux torch"
        ) from None
    register.argtypes = [ctypes.c_int8, ctypes.c_void_p]
    cuda, meta = 1, 14  # c10::DeviceType
    if registry[cuda]:
        yield
        return
    register(cuda, registry[meta])
    try:
        yield
    finally:
        register(cuda, None)


def gpu_sdpa(original):
    """torch's SDPA as a GPU runs it: on a CUDA tensor a CPU build takes the math path (every
    score held, in float32); a GPU takes flash attention (fp16/bf16, no mask, a head size it
    takes), else memory-efficient attention. The same kernels' outputs, by their meta kernels."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "cuda":
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3) for t in (key, value))
        d = query.shape[-1]
        if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and d <= 256 and d % 8 == 0:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf")
            )
        if attn_mask is not None:
            attn_mask = attn_mask.expand(query.shape[0], query.shape[-3], query.shape[-2], key.shape[-2])
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, False, dropout_p, is_causal, scale=scale
        )[0]

    return sdpa


def tile_shapes(comm, mesh, mine: dict, tiles: list) -> list[dict]:
    """runtime/vae.py's tile shape exchange, answered here (object collectives carry no fake
    data): every rank's tiles r, r + R, ... with shapes scaled from one of this rank's tiles
    by their latent extent (the decoders upsample by whole factors)."""
    ranks = mesh.world_size
    if not mine:  # only the writer reads the shapes
        return [{} for _ in range(ranks)]
    sample_k = min(mine)
    sample, ref = mine[sample_k].shape, tiles[sample_k]
    size = lambda s: s.stop - s.start  # noqa: E731

    def frames(f: int) -> int:  # the decoders' (f - 1) x ratio + 1 output frames
        ratio = (sample[-3] - 1) // (size(ref.frames) - 1) if size(ref.frames) > 1 else sample[-3]
        return (f - 1) * ratio + 1 if size(ref.frames) > 1 else f * sample[-3]

    def shape(tile) -> tuple[int, ...]:
        return (
            *sample[:-3],
            frames(size(tile.frames)),
            sample[-2] * size(tile.rows) // size(ref.rows),
            sample[-1] * size(tile.cols) // size(ref.cols),
        )

    return [{k: shape(tiles[k]) for k in range(r, len(tiles), ranks)} for r in range(ranks)]


def _tolist(self):
    """FakeTensor.tolist(): one read (recorded), then True or 0 in every place."""
    if getattr(self, "constant", None) is not None:
        return self.constant.tolist()
    if self.numel():
        self.reshape(-1)[0].item()
    fill = True if self.dtype == torch.bool else 0
    return _nested(tuple(self.shape), fill)


def move_fake_states(params, buffers, device) -> None:
    """FSDP2's move of a CPU-loaded module's states to the GPU (`_move_states_to_device`), for
    fake tensors: `tensor.data = ...` moves a fake tensor's data but not the device it reports."""
    from torch._subclasses.fake_tensor import FakeTensor

    for tensor in (*params, *buffers):
        if tensor.device == device or tensor.device.type == "meta":
            continue
        moved = tensor.to(device)
        tensor.data = moved
        if isinstance(tensor, FakeTensor):
            tensor.fake_device = moved.device


def fake_module_to(module: torch.nn.Module, device):
    """`module.to(device)` (and `move_unsplit`) after FSDP2 or a tensor-parallel split: what is
    left elsewhere (the parameters FSDP ignores, what tp keeps whole, the buffers) replaced by
    copies on `device`; DTensors stay (nn.Module.to would swap fake tensors that the fake mode
    still references)."""
    from torch.distributed.tensor import DTensor

    device = torch.device(device)
    moved: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None or isinstance(t, DTensor) or t.device == device:
                    continue
                if id(t) not in moved:
                    copy = t.detach().to(device)
                    moved[id(t)] = torch.nn.Parameter(copy, requires_grad=False) if table is sub._parameters else copy
                table[name] = moved[id(t)]
    return module


def _to_current(current: torch.device):
    """FakeTensor.to("cuda"): the current GPU, as after the launcher's torch.cuda.set_device
    (the stand-in device guard would answer "meta"; DTensor moves a split weight with it)."""
    to = torch.Tensor.to

    def call(self, *args, **kwargs):
        def fix(d):
            if isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda" and torch.device(d).index is None:
                return current
            return d

        args = tuple(fix(a) if i == 0 else a for i, a in enumerate(args))
        if "device" in kwargs:
            kwargs["device"] = fix(kwargs["device"])
        return to(self, *args, **kwargs)

    return call


def _nested(shape, fill):
    if not shape:
        return fill
    return [_nested(shape[1:], fill) for _ in range(shape[0])]


class _Stream:
    """A CUDA stream or event of the rehearsal: ordering is what a real GPU keeps; nothing to do."""

    def __init__(self, *args, **kwargs) -> None: ...

    def wait_stream(self, other) -> None: ...

    def wait_event(self, event) -> None: ...

    def record_event(self, event=None):
        return event or _Stream()

    def record(self, stream=None) -> None: ...

    def wait(self, stream=None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda(gpus_per_node: int, local: int, gpu_bytes: int, allocated):
    """torch.cuda as a machine with `gpus_per_node` GPUs of `gpu_bytes` each would answer,
    this process on GPU `local`; `allocated()`: the bytes the memory tracker holds now.
    `is_available()` stays False: torch.tensor(..., device="cuda") then makes its data on the
    host before the fake mode moves it (the runtime reads devices from the placement)."""
    from torch._subclasses.fake_tensor import FakeTensor

    props = SimpleNamespace(total_memory=gpu_bytes, name="rehearsal GPU", major=9, minor=0, multi_processor_count=132)
    patches = {
        "device_count": lambda: gpus_per_node,
        "current_device": lambda: local,
        "is_initialized": lambda: True,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (9, 0),
        "is_bf16_supported": lambda *a, **k: True,
        "mem_get_info": lambda device=None: (gpu_bytes - allocated(), gpu_bytes),
        "memory_allocated": lambda device=None: allocated(),
        "max_memory_allocated": lambda device=None: allocated(),
        "memory_reserved": lambda device=None: allocated(),
        "reset_peak_memory_stats": lambda device=None: None,
        "Stream": _Stream,
        "Event": _Stream,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
        "stream": lambda stream=None: contextlib.nullcontext(),
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.multiple(torch.cuda, **patches))
        stack.enter_context(cuda_device_guard())
        stack.enter_context(mock.patch.object(FakeTensor, "tolist", _tolist))
        stack.enter_context(mock.patch.object(FakeTensor, "to", _to_current(torch.device("cuda", local))))
        yield


def inference_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class InferenceMemTracker(MemTracker):
        """torch's MemTracker without its gradient hooks (inference: no parameter needs one)."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        # The peaks per device are all the rehearsal reads; per-module statistics refuse a
        # module run twice (the transformer every step).
        def _pre_fw_hook(self, module, inputs) -> None: ...

        def _post_fw_hook(self, module, inputs, outputs) -> None: ...

    return InferenceMemTracker()
