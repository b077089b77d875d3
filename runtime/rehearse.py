"""A rehearsal of one item's rank program at the real model's shapes, without a GPU.

Each rehearsed rank runs what `execute` runs for one item (load, text encode, a sample of the
denoising steps, the decode; not the MP4) as rank r of the real layout: the modules are built
from their configs on the meta device (runtime/models/meta.py) and placed on fake CUDA
tensors (`FakeTensorMode`: shape, dtype and device, no data), and the process groups are
torch's `fake` backend (collectives return at once). Four observers watch it:

- memory: torch's `MemTracker` per phase (load, encode, denoise, decode), against the memory
  model's figure for the same phase and rank (planner/memory.py);
- collectives: every c10d op, its bytes received by this rank by link class (intra- or
  inter-node), per denoising step, against planner/traffic.py for the same plan;
- problems: an op on another device than the rank's GPU (or a device mix), a matrix product,
  convolution or attention in a dtype the configuration does not give that module, float64 on
  the GPU, a large computation on the CPU, an exception;
- host reads: `.item()`, `int()`, `bool()`, `.tolist()` of a tensor, by call site and device
  (of a GPU tensor: a wait for the GPU on a real run). A rehearsal has no values: such a
  read returns True for a bool, 0 otherwise. Where a value decides a shape or a plan, the
  rehearsal supplies it instead: DiTango's plan replays the recorded plan shape simulate uses
  (planner/plan_shape.py), the expert schedule comes from a real scheduler on the host, and
  text masks count every token valid (the longest prompt, as the memory model assumes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from planner.decode_memory import decode_bytes
from planner.errors import ConfigError
from planner.layout import chunk_sizes, virtual_node_map
from planner.memory import GIB, estimate_memory
from planner.plan import StepPlan
from runtime.config import RunConfig, item_memory_options

PHASES = ("load", "encode", "denoise", "decode")
MODEL_PHASE = {"encode": "text_encode", "denoise": "denoise", "decode": "decode"}
TOLERANCE = 0.15  # a rank's traced against its modelled peak: more apart than this is a problem
CPU_OP_BYTES = 1 << 20  # a computation on the CPU with an output this large is a problem
# Host tensors this small carry their values through the fake mode (torch's limit is 1 element):
# a replayed DiTango plan [layers, units] is read on the host every layer.
CONSTANT_LIMIT = 1 << 16
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This project's code (an installed copy lies among the libraries: its folders say which is ours)
_OURS = tuple(os.path.join(_ROOT, name) + os.sep for name in ("runtime", "planner", "ditango_cli", "slurm", "tests"))
aten = torch.ops.aten
MATMUL_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
# What may run on the CPU at any size: making and copying tensors (diffusers draws the initial
# noise on the CPU for reproducibility; offloading copies whole modules), and views.
CPU_OK = {"empty", "empty_strided", "randn", "normal_", "_to_copy", "copy_", "detach", "clone", "zeros", "ones",
          "full", "lift_fresh", "set_", "_local_scalar_dense", "view", "_unsafe_view", "slice", "select", "t",
          "permute", "expand", "split", "alias"}  # fmt: skip


def call_site() -> str:
    """Where on the stack an op came from: the innermost frame of a library other than torch
    (diffusers, transformers), then the innermost of this project."""
    ours = library = None
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename
        if "/torch/" in path or path.endswith("rehearse.py") or "/contextlib.py" in path:
            continue
        if path.startswith(_OURS):
            ours = f"{os.path.relpath(path, _ROOT)}:{frame.lineno} ({frame.name})"
            break
        library = library or f"{path.rsplit('site-packages/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return " via ".join(p for p in (library, ours) if p) or "?"


def _in_function(path_end: str, name: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(path_end):
            return True
        frame = frame.f_back
    return False


@dataclass
class StepBytes:
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    collectives: Counter = field(default_factory=Counter)


class Watch(TorchDispatchMode):
    """Host reads, collectives and device/dtype problems of every op (see the module doc)."""

    def __init__(self, rank: int, device: torch.device, node_of: tuple[int, ...], expected: dict[str, torch.dtype]):
        super().__init__()
        self.rank, self.device, self.node_of, self.expected = rank, device, node_of, expected
        self.phase = "load"
        self.component = None  # the pipeline component whose forward runs (its name), if any
        self.keep_float32: set[str] = set()  # fqn parts of modules the loader keeps in float32
        self.modules = None  # a ModTracker: the modules running
        self.problems: Counter = Counter()
        self.reads: Counter = Counter()
        self.step: int | None = None
        self.steps: dict[int, StepBytes] = {}

    # -- reads -------------------------------------------------------------------------------
    def read(self, t: torch.Tensor):
        if getattr(t, "constant", None) is not None:  # host data the rehearsal knows (a replayed plan)
            return t.constant.item()
        self.reads[(self.phase, t.device.type, call_site())] += 1
        return True if t.dtype == torch.bool else 0

    # -- collectives -------------------------------------------------------------------------
    def _link(self, peer: int) -> str:
        return "intra_node" if self.node_of[peer] == self.node_of[self.rank] else "inter_node"

    def _received(self, peer: int, n: int) -> None:
        if self.step is None or peer == self.rank or n == 0:
            return
        bucket = self.steps.setdefault(self.step, StepBytes())
        if self._link(peer) == "intra_node":
            bucket.intra_node_bytes += n
        else:
            bucket.inter_node_bytes += n

    def collective(self, func, args) -> None:
        from runtime.comm import ring_all_reduce_bytes

        name = func.__name__.split(".")[0]
        if self.step is not None:
            self.steps.setdefault(self.step, StepBytes()).collectives[name] += 1
        if func.namespace == "_c10d_functional":  # (..., group_name): the last argument
            group = next((a for a in reversed(args) if isinstance(a, str)), None)
        else:
            group = next((a for a in args if isinstance(a, (dist.ProcessGroup, torch.ScriptObject))), None)
        if isinstance(group, str):
            group = torch.distributed.distributed_c10d._resolve_process_group(group)
        elif isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        if group is None:
            return
        ranks = dist.get_process_group_ranks(group)
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        if name in ("allreduce_", "all_reduce"):
            t = args[0][0] if isinstance(args[0], list) else args[0]
            if _in_function("runtime/comm.py", "all_reduce"):  # the control plane: a copy from every peer
                for peer in ranks:
                    self._received(peer, nbytes(t))
            elif len(ranks) > 1:  # a ring (tensor parallelism's activations), from the predecessor
                me = ranks.index(self.rank)
                self._received(ranks[me - 1], ring_all_reduce_bytes(nbytes(t), len(ranks)))
        elif name == "alltoall_base_":
            out, splits = args[0], args[3]
            row = out[0].numel() * out.element_size() if out.shape[0] else 0
            splits = list(splits) or [out.shape[0] // len(ranks)] * len(ranks)
            for peer, n in zip(ranks, splits, strict=True):
                self._received(peer, n * row)
        elif name == "all_to_all_single":
            out_splits = list(args[1]) or [args[0].shape[0] // len(ranks)] * len(ranks)
            row = args[0][0].numel() * args[0].element_size() if args[0].shape[0] else 0
            for peer, n in zip(ranks, out_splits, strict=True):
                self._received(peer, n * row)
        elif name in ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "all_gather_into_tensor"):
            # each peer's input: (outputs, inputs, ...) for the c10d ops, (input, ...) for the functional one
            inputs = args[0] if name == "all_gather_into_tensor" else args[1]
            size = sum(nbytes(t) for t in inputs) if isinstance(inputs, list) else nbytes(inputs)
            for peer in ranks:
                self._received(peer, size)
        elif name == "recv_":
            self._received(dist.get_global_rank(group, args[2]), sum(nbytes(t) for t in args[0]))
        elif name == "broadcast_":
            root = dist.get_global_rank(group, args[2])
            self._received(root, sum(nbytes(t) for t in args[0]))

    # -- problems ----------------------------------------------------------------------------
    def check(self, func, args, out) -> None:
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
        cuda = [t for t in tensors if t.device.type == "cuda"]
        for t in cuda:
            if t.device != self.device:
                self.problem(f"{func} on {t.device}, not this rank's {self.device}")
                break
        if any(t.dtype == torch.float64 for t in cuda):
            self.problem(f"{func} in float64 on the GPU")
        name = func.__name__.split(".")[0]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if (self.phase != "load" and outs and all(t.device.type == "cpu" for t in outs) and name not in CPU_OK
                and sum(t.numel() * t.element_size() for t in outs) >= CPU_OP_BYTES):  # fmt: skip
            self.problem(f"{func} ran on the CPU ({tuple(outs[0].shape)} {outs[0].dtype})")
        if func in MATMUL_OPS and cuda and self.component in self.expected:
            dtype = next(t.dtype for t in cuda if t.is_floating_point())
            want = self.expected[self.component]
            running = set() if self.modules is None else {p for fqn in self.modules.parents for p in fqn.split(".")}
            if dtype != want and not (dtype == torch.float32 and running & self.keep_float32):
                self.problem(f"{func} in {str(dtype).removeprefix('torch.')} in the {self.component} "
                             f"(configured {str(want).removeprefix('torch.')})")  # fmt: skip

    def problem(self, what: str) -> None:
        self.problems[f"{what} at {call_site()} ({self.phase})"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self.read(args[0])
        if func is aten.nonzero.default and getattr(args[0], "constant", None) is None:
            # a shape from values the rehearsal does not have: every element counts as nonzero
            self.read(args[0].reshape(-1)[:1])
            return torch.empty((args[0].numel(), args[0].dim()), dtype=torch.long, device=args[0].device)
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collective(func, args)
        out = func(*args, **kwargs)
        self.check(func, args, out)
        return out


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
        raise ConfigError(f"ditango rehearse: this torch build's libc10 does not offer its device guard registry "
                          f"({exc}); rehearse with a Linux torch") from None  # fmt: skip
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
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                             scale=scale)[0]  # fmt: skip
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf"))  # fmt: skip
        if attn_mask is not None:
            attn_mask = attn_mask.expand(query.shape[0], query.shape[-3], query.shape[-2], key.shape[-2])
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, False, dropout_p,
                                                            is_causal, scale=scale)[0]  # fmt: skip

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
        return (*sample[:-3], frames(size(tile.frames)), sample[-2] * size(tile.rows) // size(ref.rows),
                sample[-1] * size(tile.cols) // size(ref.cols))  # fmt: skip

    return [{k: shape(tiles[k]) for k in range(r, len(tiles), ranks)} for r in range(ranks)]


def _tolist(self):
    """FakeTensor.tolist(): one read (recorded), then True or 0 in every place."""
    if getattr(self, "constant", None) is not None:
        return self.constant.tolist()
    if self.numel():
        self.reshape(-1)[0].item()
    fill = True if self.dtype == torch.bool else 0
    return _nested(tuple(self.shape), fill)


def _move_fake_states(params, buffers, device) -> None:
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


def _fake_module_to(module: torch.nn.Module, device):
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

    props = SimpleNamespace(total_memory=gpu_bytes, name="rehearsal GPU", major=9, minor=0,
                            multi_processor_count=132)  # fmt: skip
    patches = {
        "device_count": lambda: gpus_per_node, "current_device": lambda: local, "is_initialized": lambda: True,
        "set_device": lambda device: None, "synchronize": lambda device=None: None, "empty_cache": lambda: None,
        "get_device_properties": lambda device=None: props, "get_device_capability": lambda device=None: (9, 0),
        "is_bf16_supported": lambda *a, **k: True, "mem_get_info": lambda device=None: (gpu_bytes - allocated(), gpu_bytes),
        "memory_allocated": lambda device=None: allocated(), "max_memory_allocated": lambda device=None: allocated(),
        "memory_reserved": lambda device=None: allocated(), "reset_peak_memory_stats": lambda device=None: None,
        "Stream": _Stream, "Event": _Stream, "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(), "stream": lambda stream=None: contextlib.nullcontext(),
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.multiple(torch.cuda, **patches))
        stack.enter_context(cuda_device_guard())
        stack.enter_context(mock.patch.object(FakeTensor, "tolist", _tolist))
        stack.enter_context(mock.patch.object(FakeTensor, "to", _to_current(torch.device("cuda", local))))
        yield


class ReplayPlanner:
    """DiTango's planner replaced by fixed plans per step (a rehearsal has no attention
    states to plan from): the interface SelectiveRuntime uses."""

    def __init__(self, plans: dict[int, StepPlan], planner_class) -> None:
        self.plans = plans
        self.observes_anchors = planner_class.observes_anchors
        self.keeps_exact_states = planner_class.keeps_exact_states
        self.switches: tuple[int, ...] = ()
        self._last: StepPlan | None = None

    def plan(self, step: int) -> StepPlan:
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        p = self.plans[step]
        self._last = p
        mode = detect_fake_mode()
        with unset_fake_temporarily():
            bits = p.compute_LU.clone()
        if mode is not None:  # a fake host tensor that carries its values (see CONSTANT_LIMIT)
            bits = mode.fake_tensor_converter.from_real_tensor(mode, bits, make_constant=True)
        return StepPlan(p.step, p.kind, bits, p.epsilon)

    def observes(self, kind: str) -> bool:
        return kind == "selective" or (kind == "anchor" and self.observes_anchors)

    def observe(self, step, scores_LU, gate) -> None: ...

    def not_run(self, step, missing_L) -> None: ...

    def last_plan(self) -> StepPlan:
        assert self._last is not None
        return self._last


def spread(fraction: float, layers: int) -> list[bool]:
    """`fraction` of `layers` as evenly spaced True layers (round(fraction x layers) of them)."""
    n = round(fraction * layers)
    return [(i + 1) * n // layers > i * n // layers for i in range(layers)]


def replayed_plans(cfg: RunConfig, layers: int, steps: int, switches: tuple[int, ...]) -> dict[int, StepPlan]:
    """Per step, the plan simulate prices for this layout (the recorded plan shape at the run's
    cache ratio, planner/plan_shape.py): exact warm-up and cool-down steps, an anchor after the
    warm-up and at each expert switch, the other steps selective with each unit computed in an
    evenly spread round(fraction x layers) of the layers."""
    from planner.plan_shape import recorded_source

    planner = cfg.ditango.planner
    source = recorded_source(planner.planner, planner.cache_ratio, planner.own_group, planner.warmup, planner.cooldown)
    replay = source.replay(cfg.layout, layers, steps)
    fractions = replay.selective_U
    units = len(fractions)
    plans = {}
    for step in range(steps):
        if replay.selective + replay.anchors == 0 or step < planner.warmup or step >= steps - planner.cooldown:
            kind, bits = "exact", torch.ones(layers, units, dtype=torch.bool)
        elif step == planner.warmup or step in switches:
            kind, bits = "anchor", torch.ones(layers, units, dtype=torch.bool)
        else:
            kind = "selective"
            bits = torch.tensor([spread(f, layers) for f in fractions], dtype=torch.bool).T.reshape(layers, units)
        plans[step] = StepPlan(step, kind, bits, None)
    return plans


def sample_steps(plans: dict[int, StepPlan] | None, steps: int, switches: tuple[int, ...]) -> list[int]:
    """The steps a rehearsal runs: the first of each kind the plan has (two exact steps
    without DiTango: the multistep solver's first and second order), and each switch."""
    if not plans:
        return sorted({0, min(1, steps - 1), *switches})
    firsts: dict[str, int] = {}
    for step, p in sorted(plans.items()):
        firsts.setdefault(p.kind, step)
    return sorted({*firsts.values(), *switches})


def rehearsed_ranks(cfg: RunConfig, all_ranks: bool) -> list[int]:
    """The ranks whose shapes differ: the first (the writer), the last, the first rank of each
    distinct chunk size and of each CFG group; every rank with `all_ranks`."""
    layout = cfg.layout
    if all_ranks:
        return list(range(layout.world_size))
    tokens = cfg.items[0].tokens()
    sizes = chunk_sizes(tokens, layout.cp_degree) if layout.strategy != "tp" else [tokens]
    first_of_size = {size: c for c, size in reversed(list(enumerate(sizes)))}
    ranks = {0, layout.world_size - 1, *first_of_size.values()}
    if layout.cfg_degree == 2:
        ranks.add(layout.cp_degree)
    return sorted(ranks)


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


def modelled_phases(cfg: RunConfig, shape, rank: int, dtype_bytes: int) -> dict[str, int]:
    """The memory model's bytes of each phase on `rank` for the first item (the writer decodes
    alone unless the decode is parallel; the others hold only what stays)."""
    (h, w, f), options = next(item_memory_options(replace(cfg, items=cfg.items[:1]), dtype_bytes))
    options = replace(options, offload_text_encoder="text_encoder" in cfg.offload,
                      offload_transformer="transformer" in cfg.offload)  # fmt: skip
    est = estimate_memory(shape, cfg.layout, h, w, f, options)
    nccl = est.stages["nccl"]  # NCCL's buffers: estimated, a fake process group has none to trace
    phases = {"load": est.phases["load"] - nccl, **{p: est.phases[m] - nccl for p, m in MODEL_PHASE.items()}}
    decode = est.resident["decode"].get("vae_decode", 0)
    if options.vae_parallel and shape.vae is not None:  # this rank's tiles (the writer: all of them, blended)
        latent = shape.latent_shape(h, w, f)
        phases["decode"] += decode_bytes(shape.vae, latent, True, options.tile_px, cfg.layout.world_size, rank) - decode
    elif rank != 0:
        phases["decode"] -= decode
    return phases


def modelled_step_bytes(cfg: RunConfig, shape, rank: int, plan: StepPlan | None, dtype_bytes: int,
                        roots: int = 0, step: int = 0) -> dict:  # fmt: skip
    """planner/traffic.py's bytes received by `rank` in one step of `plan` (None: exact); `roots`:
    transformers whose first forward it is (FSDP gathers their root units then)."""
    from planner.traffic import predict_traffic

    item = cfg.items[0]
    guidance = item.cfg_scale > 1
    extra = {}
    if plan is not None:
        forwards = 1 if cfg.layout.cfg_degree == 2 else (2 if guidance else 1)
        planner = cfg.ditango.planner
        extra = {"plan_bits": [plan.compute_LU.tolist()] * forwards, "plan_kinds": [plan.kind],
                 "own_group": planner.own_group, "planner": planner.planner}  # fmt: skip
    return predict_traffic(cfg.layout, shape, item.height, item.width, item.frames, 1, guidance=guidance,
                           element_bytes=dtype_bytes, rank=rank, shard_weights=cfg.shard_weights, roots=roots,
                           step_cache=None if cfg.step_cache is None else cfg.step_cache.name, first_step=step == 0,
                           **extra)  # fmt: skip


def _on_component(watch: Watch, components: dict) -> None:
    """Tell `watch` which component's forward runs (the dtype it is configured for)."""
    for name, module in components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        watch.keep_float32 |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        module.register_forward_pre_hook(lambda m, a, name=name: setattr(watch, "component", name))
        module.register_forward_hook(lambda m, a, o: setattr(watch, "component", None))


def rehearse_rank(cfg: RunConfig, spec, path, rank: int, gpu_bytes: int, steps_run: list[int],
                  plans: dict[int, StepPlan] | None, experts: list[int]) -> dict:  # fmt: skip
    """One rank's rehearsal (see the module doc): its report."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.distributed.fsdp._fully_shard import _fsdp_init as fsdp_init
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import runtime.assembly as assembly
    import runtime.denoiser as denoiser_module
    import runtime.vae as vae_module
    from runtime.comm import Comm
    from runtime.inputs import item_inputs
    from runtime.kernels import resolve_backend
    from runtime.mesh import build_mesh
    from runtime.models.families import FAMILIES
    from runtime.models.loading import placement_on
    from runtime.models.meta import materialize, meta_components
    from runtime.run import RankContext, before_decode, denoiser_for_run, run_host_loaded
    from runtime.vae import decode_video
    from runtime.weights import shard_weights

    layout, item = cfg.layout, cfg.items[0]
    node_of = virtual_node_map(layout)
    device = torch.device("cuda", rank % layout.gpus_per_node)
    placement = placement_on(device, cfg.dtype)
    dtype = placement.dtype
    expected = {"transformer": dtype, "transformer_2": dtype, "text_encoder": dtype, "text_encoder_2": dtype,
                "vae": torch.float32, "image_encoder": torch.float32}  # fmt: skip
    watch = Watch(rank, device, node_of, expected)
    tracker = inference_tracker()
    traced: dict[str, int] = {}

    def allocated() -> int:
        return tracker.get_tracker_snapshot().get(device, {}).get("Total", 0)

    @contextlib.contextmanager
    def phase(name: str):
        watch.phase = name
        with tracker:
            yield
        traced[name] = tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)

    def real_timesteps(scheduler) -> list[float]:
        with (
            unset_fake_temporarily(),
            mock.patch.object(denoiser.model, "device", torch.device("cpu")),
        ):
            return denoiser.new_scheduler(len(scheduler.timesteps)).timesteps.tolist()

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    error = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(fake_cuda(layout.gpus_per_node, device.index, gpu_bytes, allocated))
            watch.modules = stack.enter_context(ModTracker())
            stack.enter_context(watch)
            stack.enter_context(mock.patch.object(denoiser_module, "host_timesteps", real_timesteps))
            stack.enter_context(mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", CONSTANT_LIMIT))
            stack.enter_context(mock.patch.object(fsdp_init, "_move_states_to_device", _move_fake_states))
            for family in FAMILIES.values():  # a text mask read on the host: no values here, every token valid
                if hasattr(family, "valid_text_tokens"):
                    stack.enter_context(mock.patch.object(family, "valid_text_tokens", lambda mask_L: mask_L.shape[0]))
            stack.enter_context(mock.patch.object(vae_module, "tile_shapes", tile_shapes))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", gpu_sdpa(sdpa)))
            stack.enter_context(
                mock.patch.object(Comm, "gather_objects", lambda self, obj, group, ranks: [obj] * len(ranks))
            )
            stack.enter_context(mock.patch.object(Comm, "broadcast_object", lambda self, obj, src, group: obj))
            try:
                with phase("load"):
                    mesh = build_mesh(layout, rank, node_of, cfg.timeout_s, device, control_backend="fake")
                    ctx = RankContext(mesh, Comm(mesh))
                    components = meta_components(spec, path, dtype, cfg.max_text_len)
                    on_cpu = run_host_loaded(cfg, ctx)
                    for name, module in components.items():
                        if isinstance(module, torch.nn.Module):
                            materialize(module, torch.device("cpu") if name in on_cpu else device)
                    backend = "diffusers" if layout.strategy == "none" else resolve_backend(
                        cfg.attention_backend, device, dtype)  # fmt: skip
                    # modules moved to the GPU as for fake tensors (see _move_fake_states)
                    with mock.patch.object(torch.nn.Module, "to", _fake_module_to), \
                            mock.patch.object(assembly, "move_unsplit", _fake_module_to):  # fmt: skip
                        if cfg.shard_weights and ctx.distributed:
                            shard_weights(components, mesh, device)
                        denoiser = denoiser_for_run(cfg, ctx, spec, components, placement, backend)
                    _on_component(watch, components)
                    listener = denoiser.listener
                    if denoiser.ditango is not None:
                        _replay(denoiser.ditango, plans)
                with phase("encode"):
                    text, latents, condition = item_inputs(denoiser, item, cfg)
                with phase("denoise"):
                    watch.step = steps_run[0] if listener is None else None
                    if listener is not None:
                        begin = listener.begin_step
                        listener.begin_step = lambda i: (setattr(watch, "step", i), begin(i))[1]

                    def step_done(done: int, steps: int) -> None:
                        later = [s for s in steps_run if s >= done]
                        watch.step = later[0] if listener is None and later else None

                    result = denoiser.denoise(latents, text, item.steps, item.cfg_scale, on_step=step_done,
                                              condition=condition, guidance_2=item.guidance_2,
                                              run_steps=frozenset(steps_run))  # fmt: skip
                with phase("decode"):
                    options = before_decode(denoiser, cfg, ctx)
                    if options is not None:
                        decode_video(denoiser.vae, denoiser.vae_input(result.latents_BCFHW), options, ctx)
            except Exception as exc:  # what a real run would have raised on this rank
                error = exc
                frames = [f for f in traceback.extract_tb(exc.__traceback__)
                          if f.filename.startswith(_OURS) and not f.filename.endswith("rehearse.py")]  # fmt: skip
                where = f"{os.path.relpath(frames[-1].filename, _ROOT)}:{frames[-1].lineno}" if frames else "?"
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                watch.problems[f"{type(exc).__name__}: {first} at {where} ({watch.phase})"] += 1
    finally:
        dist.destroy_process_group()
    return rank_report(cfg, spec, rank, traced, watch, plans, steps_run, dtype.itemsize, error is not None, experts)


def _replay(selective, plans: dict[int, StepPlan] | None) -> None:
    """DiTango's runtime with the replayed plans, its agreed cache cap the rank's own."""
    allocate, agree = selective.allocate, selective._agree_min

    def replayed_allocate(*args, **kwargs):
        allocate(*args, **kwargs)
        selective.planner = ReplayPlanner(plans or {}, selective.planner_class)

    def replayed_end_step(step: int) -> None:
        """end_step's collectives (the statistics a planner would observe), without its host
        bookkeeping of values the rehearsal does not have."""
        plan = selective.step_plan
        group, ranks = selective._plan_group()
        if group is not None and selective.planner.observes(plan.kind):
            stats = torch.zeros(selective.layers * selective.units + 1, device=selective._device)
            selective.comm.all_reduce(stats, dist.ReduceOp.SUM, group, ranks)

    selective.allocate = replayed_allocate
    selective.end_step = replayed_end_step
    selective._agree_min = lambda value: (agree(value), value)[1]


def rank_report(cfg, spec, rank, traced, watch: Watch, plans, steps_run, dtype_bytes, failed: bool,
                experts: list[int]) -> dict:  # fmt: skip
    modelled = modelled_phases(cfg, spec.shape, rank, dtype_bytes)
    phases = {}
    for name in PHASES:
        if name not in traced:
            continue
        t, m = traced[name], modelled[name]
        phases[name] = {"traced_bytes": t, "modelled_bytes": m, "ratio": round(t / m, 4) if m else None}
    steps = []
    for step in steps_run:
        got = watch.steps.get(step, StepBytes())
        plan = plans.get(step) if plans else None
        first = step == next(s for s in steps_run if experts[s] == experts[step])  # the expert's first forward
        model = modelled_step_bytes(cfg, spec.shape, rank, plan, dtype_bytes, roots=int(first), step=step)
        steps.append({"step": step, "kind": plan.kind if plan else "exact",
                      "intra_node_bytes": got.intra_node_bytes, "inter_node_bytes": got.inter_node_bytes,
                      "modelled_intra_node_bytes": model["intra_node_bytes"],
                      "modelled_inter_node_bytes": model["inter_node_bytes"],
                      "collectives": dict(sorted(got.collectives.items()))})  # fmt: skip
    problems = [f"{what}" + (f" ({n} times)" if n > 1 else "") for what, n in sorted(watch.problems.items())]
    peak = None
    if phases and not failed:  # the rank's peak, over its phases, is what the pre-flight budgets
        traced_peak = max(p["traced_bytes"] for p in phases.values())
        modelled_peak = max(p["modelled_bytes"] for p in phases.values())
        peak = {"traced_bytes": traced_peak, "modelled_bytes": modelled_peak,
                "ratio": round(traced_peak / modelled_peak, 4) if modelled_peak else None}  # fmt: skip
        if peak["ratio"] is None or abs(peak["ratio"] - 1) > TOLERANCE:
            problems.append(f"traced peak {traced_peak / GIB:.2f} GiB, the memory model says "
                            f"{modelled_peak / GIB:.2f} GiB ({peak['ratio']}x)")  # fmt: skip
    if not failed:
        for s in steps:
            for link in ("intra_node_bytes", "inter_node_bytes"):
                if s[link] != s[f"modelled_{link}"]:
                    problems.append(f"step {s['step']} ({s['kind']}): {s[link]} {link.replace('_', ' ')} received, "
                                    f"planner/traffic.py counts {s[f'modelled_{link}']}")  # fmt: skip
    count = max(1, len(steps))
    return {
        "rank": rank, "node": virtual_node_map(cfg.layout)[rank], "phases": phases, "peak": peak,
        "bytes_per_step": {k: sum(s[k] for s in steps) // count for k in ("intra_node_bytes", "inter_node_bytes")},
        "modelled_bytes_per_step": {k: sum(s[f"modelled_{k}"] for s in steps) // count
                                    for k in ("intra_node_bytes", "inter_node_bytes")},
        "steps": steps,
        "host_reads": [{"phase": p, "device": d, "site": site, "count": n} for (p, d, site), n in sorted(watch.reads.items())],
        "problems": problems,
    }  # fmt: skip


def rehearse(cfg: RunConfig, spec, path, gpu_bytes: int, all_ranks: bool = False, on_rank=None) -> dict:
    """Rehearse the first item of `cfg` on the ranks whose shapes differ (all with
    `all_ranks`); `on_rank(report)` after each. The report `ditango rehearse --json` prints."""
    from runtime.denoiser import switch_steps

    item = cfg.items[0]
    experts = [0] * item.steps
    if spec.variant.experts == 2:
        from runtime.models.meta import meta_scheduler

        scheduler = meta_scheduler(spec, path)
        scheduler.set_timesteps(item.steps, device="cpu")
        boundary = spec.variant.boundary_ratio * scheduler.config.num_train_timesteps
        experts = [0 if t >= boundary else 1 for t in scheduler.timesteps.tolist()]
    switches = switch_steps(experts)
    plans = None
    if cfg.ditango is not None:
        plans = replayed_plans(cfg, spec.layers, item.steps, switches)
    steps_run = sample_steps(plans, item.steps, switches)
    reports = []
    for rank in rehearsed_ranks(cfg, all_ranks):
        reports.append(rehearse_rank(cfg, spec, path, rank, gpu_bytes, steps_run, plans, experts))
        if on_rank is not None:
            on_rank(reports[-1])
    totals = None
    if len(reports) == cfg.layout.world_size:
        totals = {k: sum(r["bytes_per_step"][k] for r in reports) for k in ("intra_node_bytes", "inter_node_bytes")}
    return {
        "model": cfg.model, "item": {"height": item.height, "width": item.width, "frames": item.frames,
                                      "steps": item.steps, "tokens": item.tokens()},
        "layout": cfg.layout.to_json(), "gpu_memory_bytes": gpu_bytes, "offload": list(cfg.offload),
        "steps_rehearsed": [{"step": s, "kind": plans[s].kind if plans else "exact"} for s in steps_run],
        "ranks": reports, "bytes_per_step_all_ranks": totals,
        "problems": sorted({f"rank {r['rank']}: {p}" for r in reports for p in r["problems"]}),
    }  # fmt: skip
