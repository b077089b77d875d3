"""Tensor parallelism (`--parallel tp`) over a replica's cp group: every rank holds the whole
token sequence and 1/n of each block's attention heads and FFN width.

Shape legend: B batch, S tokens (the whole sequence, on every rank), C channels (all heads),
c = C / n this rank's channels, h this rank's heads, D head dim, n the group's size.

The split of a block is Megatron-LM's (Shoeybi et al. 2019, section 3): the q/k/v projections
column-wise (a rank computes its h heads, [B, S, C] -> [B, S, c]), their attention locally,
the output projection row-wise (its c input channels: a partial [B, S, C], summed over the
group by one all-reduce); the FFN's up-projection column-wise, its down-projection row-wise
(one more all-reduce). The family adapter names the modules (runtime/models/wan/
`install_tp`); this module splits them.

- Linear layers: PyTorch's DTensor plans (`ColwiseParallel`, `RowwiseParallel`) over a
  DeviceMesh made from the cp group (gloo on CPU, NCCL on CUDA). Every rank loaded the same
  weights, so each keeps its slice without a message (`src_data_rank=None`) and the whole
  weight is dropped. DTensor runs the row-wise all-reduce itself; it is counted from a forward
  hook on the module (its output's bytes, as a ring moves them: runtime/comm.py).
- RMS norm across heads (Wan normalises q and k over all C channels): exact, with one
  all-reduce of the local sum of squares, a float32 [B, S, 1] statistic, through Comm
  (`HeadShardedRMSNorm`).
- Undoing (`Parallelized.remove`) gathers each weight back whole: a collective, so every rank
  of the group removes, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from basics.errors import ConfigError
from runtime.comm import Comm
from runtime.compile import all_reduce_, register, tally
from runtime.kernels import Backend, attention
from runtime.mesh import Mesh

Undo = Callable[[], None]


class TensorParallel:
    """The group a transformer's blocks are split over, and the splits an adapter installs with.

    Each split replaces a module or attribute in place and returns the `Undo` that restores it.
    On a group of one rank nothing is split.
    """

    def __init__(self, mesh: Mesh, comm: Comm, backend: Backend, split_one: bool = False) -> None:
        """`split_one`: split on a group of one rank too (DTensors over a one-rank mesh: the
        GPU check exercises the DTensor path on one GPU; the runtime never asks for it)."""
        self.mesh, self.comm, self.backend = mesh, comm, backend
        self.ranks = mesh.cp_ranks
        self.degree = len(self.ranks)
        self.index = mesh.cp_index
        self.split = self.degree > 1 or split_one
        self.device_mesh = None
        self.handle = register(self)  # for a compiled block's ops (runtime/compile.py)
        self.calls = torch.zeros((), dtype=torch.int64)  # the counted results (`compile.tally`)
        if self.split:
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            self.device_mesh = DeviceMesh.from_group(mesh.cp_group or dist.group.WORLD, mesh.device.type)

    def __repr__(self) -> str:
        return f"TensorParallel(degree={self.degree}, index={self.index}, ranks={self.ranks})"

    def local(self, n: int, what: str) -> int:
        """This rank's share of `n` heads or channels; a one-line error when n does not split."""
        if n % self.degree:
            raise ConfigError(f"tp degree {self.degree} must divide the model's {n} {what}")
        return n // self.degree

    # -- splits ------------------------------------------------------------------------
    def colwise(self, parent: nn.Module, name: str) -> Undo:
        """`parent.<name>` (a Linear [out, in]) keeps its rows of this rank: [.., in] -> [.., out / n]."""
        from torch.distributed.tensor.parallel import ColwiseParallel

        return self._linear(parent, name, ColwiseParallel())

    def rowwise(self, parent: nn.Module, name: str) -> Undo:
        """`parent.<name>` (a Linear) keeps its input columns of this rank: [.., in / n] -> [.., out],
        summed over the group (DTensor's all-reduce, counted here)."""
        from torch.distributed.tensor.parallel import RowwiseParallel

        return self._linear(parent, name, RowwiseParallel(), count=True)

    def norm(self, parent: nn.Module, name: str) -> Undo:
        """`parent.<name>` (an RMSNorm over C) becomes one over this rank's c channels, exact."""
        whole = getattr(parent, name)
        if not self.split:
            return _nothing
        setattr(parent, name, HeadShardedRMSNorm(whole, self))
        return lambda: setattr(parent, name, whole)

    def set(self, obj, attr: str, value) -> Undo:
        """`obj.<attr> = value` (a module's head count), undone to the old value."""
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        return lambda: setattr(obj, attr, old)

    def _linear(self, parent: nn.Module, name: str, style, count: bool = False) -> Undo:
        from torch.distributed.tensor.parallel import parallelize_module

        whole = getattr(parent, name)
        assert type(whole) is nn.Linear, f"tp splits plain Linear layers, got {type(whole).__name__} at {name}"
        if not self.split:
            return _nothing
        # A fresh module takes the parameters, so the plan's hooks leave with it on undo.
        split = _linear_from(whole.weight, whole.bias)
        parallelize_module(split, self.device_mesh, style, src_data_rank=None)
        own_storage(split)
        if count:
            split.register_forward_hook(lambda module, args, out: tally(self, out))
        setattr(parent, name, split)
        return lambda: setattr(parent, name, _gathered(split))

    # -- collectives and attention (called by the installed modules) -----------------------
    def all_reduce(self, x: torch.Tensor) -> None:
        """In-place sum over the group, counted under "tp"."""
        self.comm.ring_all_reduce(x, self.mesh.cp_group, self.ranks)

    def count(self, out: torch.Tensor) -> None:
        """Count a row-wise layer's result, summed over the group by DTensor's all-reduce."""
        self.comm.count_ring_all_reduce(out.numel() * out.element_size(), self.ranks)

    def attention(self, q_BShD, k_BShD, v_BShD, scale: float, layer: int = 0) -> torch.Tensor:
        """The local heads' attention over the whole sequence, [B, S, h, D] in q's dtype."""
        return attention(q_BShD, k_BShD, v_BShD, scale, self.backend).out_BSHD.to(q_BShD.dtype)


class HeadShardedRMSNorm(nn.Module):
    """RMS norm over all C channels of a tensor this rank holds c = C / n channels of.

    The local sum of squares [B, S, 1] (float32) is summed over the group, so every rank
    divides by the same statistic as the whole norm: x * rsqrt(sum(x^2) / C + eps) * w, with
    this rank's slice of the weight w. Computed in float32 and cast back, as torch's RMSNorm.
    """

    def __init__(self, whole: nn.RMSNorm, tp: TensorParallel) -> None:
        super().__init__()
        assert isinstance(whole, nn.RMSNorm) and len(whole.normalized_shape) == 1, "an RMS norm over the channels"
        self.channels = whole.normalized_shape[0]
        self.eps = whole.eps
        self.tp = tp
        c = tp.local(self.channels, "channels of an RMS norm")
        self.weight = None
        if whole.weight is not None:
            part = whole.weight.detach()[tp.index * c : (tp.index + 1) * c].clone()
            self.weight = nn.Parameter(part, requires_grad=whole.weight.requires_grad)

    def forward(self, x_BSc: torch.Tensor) -> torch.Tensor:
        x = x_BSc.float()
        squares_BS1 = x.square().sum(dim=-1, keepdim=True)
        all_reduce_(self.tp, squares_BS1)
        eps = torch.finfo(x_BSc.dtype).eps if self.eps is None else self.eps  # torch's RMSNorm default
        out = x * torch.rsqrt(squares_BS1 / self.channels + eps)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.to(x_BSc.dtype)


def check_unsharded(transformer: nn.Module) -> None:
    """tp splits whole weights: a transformer already sharded (--shard-weights) is refused."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in transformer.parameters()):
        raise ConfigError("--shard-weights does not combine with --parallel tp (tp already splits the block weights)")


def own_storage(module: nn.Module) -> None:
    """Make every DTensor parameter's local shard own exactly its bytes. Sharded without a message
    (`src_data_rank=None`), a shard may be a view of the whole weight, which then stays alive
    and the split saves no memory (torch 2.13 copies; this does not rely on it)."""
    from torch.distributed.tensor import DTensor

    for name, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            continue
        local = p.to_local()
        if local.untyped_storage().nbytes() != local.numel() * local.element_size():
            own = DTensor.from_local(
                local.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            setattr(module, name, nn.Parameter(own, requires_grad=p.requires_grad))
        local = getattr(module, name).to_local()
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), f"{name}: a shard's storage"


def _nothing() -> None:
    return None


def _linear_from(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """A Linear holding these parameters (built on the meta device: nothing allocated)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    return linear


def _gathered(split: nn.Linear) -> nn.Linear:
    """The whole Linear again from a split one's shards (an all-gather over the group)."""

    def whole(p: nn.Parameter | None) -> nn.Parameter | None:
        if p is None:
            return None
        full = p.full_tensor()
        full = full.wait() if hasattr(full, "wait") else full  # an AsyncCollectiveTensor: its data, now
        return nn.Parameter(full.clone(), requires_grad=p.requires_grad)

    return _linear_from(whole(split.weight), whole(split.bias))


def build(ctx, transformers, options) -> TensorParallel:
    """Tensor parallelism over the cp group (planner/strategies/tensor.py); the families' `install_tp` splits."""
    for transformer in transformers:
        check_unsharded(transformer)
    return TensorParallel(ctx.mesh, ctx.comm, ctx.backend)
