"""What a rehearsed rank is watched for (runtime/rehearse/): every op dispatched, as a
`TorchDispatchMode`: ops off the rank's GPU or mixing devices, a matmul, convolution or
attention in a dtype the configuration does not give its module, float64 on the GPU, large
computations on the CPU, host reads of tensors by call site (a boolean selection's size is
one: known.py answers it), and the bytes each collective receives by link class and step."""

from __future__ import annotations

import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.rehearse.known import MASK_DTYPES, Known

CPU_OP_BYTES = 1 << 20  # a computation on the CPU with an output this large is a problem
HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
ROOT = os.path.dirname(os.path.dirname(HERE.rstrip(os.sep)))
# Never a call site: the rehearsal's own code, and a test's (a defect it plants is reported
# where the tool's code called it).
NOT_SITES = (HERE, os.path.join(ROOT, "tests") + os.sep)
# This project's code (an installed copy lies among the libraries: its folders say which is ours)
OURS = tuple(os.path.join(ROOT, name) + os.sep for name in ("runtime", "planner", "ditango_cli", "slurm", "tests"))
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
# Ops that take boolean masks among their indices (their size from the mask's values)
SELECTIONS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
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
        if "/torch/" in path or path.startswith(NOT_SITES) or "/contextlib.py" in path:
            continue
        if path.startswith(OURS):
            ours = f"{os.path.relpath(path, ROOT)}:{frame.lineno} ({frame.name})"
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
        self.known = Known()

    # -- reads -------------------------------------------------------------------------------
    def read(self, t: torch.Tensor):
        if getattr(t, "constant", None) is not None:  # host data the rehearsal knows (a replayed plan)
            return t.constant.item()
        self.reads[(self.phase, t.device.type, call_site())] += 1
        known = self.known.get(t)  # a fill's value (runtime/rehearse/known.py)
        if known is not None:
            return known
        return True if t.dtype == torch.bool else 0

    def select(self, args: tuple) -> tuple:
        """`args` of a boolean selection (`x[mask]`, `x[mask] = v`) with each mask the rehearsal
        has no values of replaced by the integer indices it selects (known.py); the selection's
        size is a read (a GPU's boolean indexing waits for it)."""
        indices = args[1]
        if not any(_unknown_mask(i) for i in indices):
            return args
        replaced = []
        for i in indices:
            if _unknown_mask(i):
                self.reads[(self.phase, i.device.type, call_site())] += 1
                replaced += self.known.selection(i)
            else:
                replaced.append(i)
        return (args[0], replaced, *args[2:])

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
        if (
            self.phase != "load"
            and outs
            and all(t.device.type == "cpu" for t in outs)
            and name not in CPU_OK
            and sum(t.numel() * t.element_size() for t in outs) >= CPU_OP_BYTES
        ):
            self.problem(f"{func} ran on the CPU ({tuple(outs[0].shape)} {outs[0].dtype})")
        if func in MATMUL_OPS and cuda and self.component in self.expected:
            dtype = next(t.dtype for t in cuda if t.is_floating_point())
            want = self.expected[self.component]
            running = set() if self.modules is None else {p for fqn in self.modules.parents for p in fqn.split(".")}
            if dtype != want and not (dtype == torch.float32 and running & self.keep_float32):
                self.problem(
                    f"{func} in {str(dtype).removeprefix('torch.')} in the {self.component} "
                    f"(configured {str(want).removeprefix('torch.')})"
                )

    def problem(self, what: str) -> None:
        self.problems[f"{what} at {call_site()} ({self.phase})"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self.read(args[0])
        if func is aten.nonzero.default and getattr(args[0], "constant", None) is None:
            # a shape from values the rehearsal does not have: every element, or none (known.py)
            mask = args[0]
            self.reads[(self.phase, mask.device.type, call_site())] += 1
            n = mask.numel() if self.known.selected(mask) else 0
            return torch.empty((n, mask.dim()), dtype=torch.long, device=mask.device)
        if func in SELECTIONS:
            args = self.select(args)
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collective(func, args)
        out = func(*args, **kwargs)
        self.check(func, args, out)
        self.known.after(func, args, kwargs, out)
        return out


def _unknown_mask(index) -> bool:
    """A boolean index (of at least one dimension) whose values the fake mode does not carry."""
    return (
        isinstance(index, torch.Tensor)
        and index.dtype in MASK_DTYPES
        and index.dim() > 0
        and getattr(index, "constant", None) is None
    )
