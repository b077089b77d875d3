"""Transport with explicit groups and byte counters per link class.

Bytes are counted on the receiving rank, by the link the bytes crossed (the sender's
node vs ours: `intra_node` or `inter_node`) and by purpose (`attention` for KV/QKV
exchange, `gather` for collecting the sharded output, `control` for the small collectives
that keep ranks in step). Summed over ranks, received bytes equal sent bytes, so the totals
are what crossed each kind of link. Control collectives are counted by convention: an
all-reduce as the copy of the tensor each peer would send in an all-gather (at least what a
ring all-reduce moves), an object collective as its pickled payload (padded to the largest,
as torch pads them). Tensor parallelism's all-reduces (`tp`) are counted as NCCL's ring
all-reduce moves them instead (`count_ring_all_reduce`): they carry the activations, and the
cost model prices them per link.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from planner.traffic import ring_all_reduce_bytes
from runtime.mesh import Mesh
from runtime.profiling import region


class PendingRecv:
    """An in-flight P2P exchange; `wait()` returns what was received: a tensor, or a tuple of
    them when a tuple was sent."""

    def __init__(self, works: list, buffers: tuple[torch.Tensor, ...], single: bool) -> None:
        self._works = works
        self.buffers = buffers
        self._single = single

    def wait(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        with region("exchange"):
            for work in self._works:
                work.wait()
        return self.buffers[0] if self._single else self.buffers


class Comm:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.bytes: defaultdict[tuple[str, str], int] = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()

    def totals(self) -> dict:
        """{"intra_node_bytes", "inter_node_bytes", "by_purpose": {purpose: {link: bytes}}}."""
        out = {"intra_node_bytes": 0, "inter_node_bytes": 0, "by_purpose": {}}
        for (purpose, link), n in sorted(self.bytes.items()):
            out[f"{link}_bytes"] += n
            out["by_purpose"].setdefault(purpose, {})[f"{link}_bytes"] = n
        return out

    def _count(self, src: int, nbytes: int, purpose: str) -> None:
        if src != self.mesh.rank:
            self.bytes[(purpose, self.mesh.link(src))] += nbytes

    def all_reduce(self, tensor: torch.Tensor, op, group, ranks: Sequence[int], purpose: str = "control") -> None:
        """In-place all-reduce over `group` (global `ranks`), counted under `purpose`."""
        with region("exchange"):
            dist.all_reduce(tensor, op=op, group=group)
        for peer in ranks:
            self._count(peer, tensor.numel() * tensor.element_size(), purpose)

    def ring_all_reduce(self, tensor: torch.Tensor, group, ranks: Sequence[int], purpose: str = "tp") -> None:
        """In-place sum over `group` (global `ranks`, in group order), counted as a ring moves it."""
        with region("exchange"):
            dist.all_reduce(tensor, group=group)
        self.count_ring_all_reduce(tensor.numel() * tensor.element_size(), ranks, purpose)

    def count_ring_all_reduce(self, nbytes: int, ranks: Sequence[int], purpose: str = "tp") -> None:
        """Count an all-reduce of `nbytes` over `ranks` (run here or by DTensor): a ring in group
        order, each member receiving `ring_all_reduce_bytes` from its predecessor."""
        n = len(ranks)
        if n > 1:
            predecessor = ranks[(list(ranks).index(self.mesh.rank) - 1) % n]
            self._count(predecessor, ring_all_reduce_bytes(nbytes, n), purpose)

    def gather_objects(self, obj, group, ranks: Sequence[int]) -> list:
        """Every member's picklable `obj`, in rank order (control plane)."""
        out = [None] * len(ranks)
        dist.all_gather_object(out, obj, group=group)
        size = max(len(pickle.dumps(o)) for o in out)
        for peer in ranks:
            self._count(peer, size, "control")
        return out

    def broadcast_object(self, obj, src: int, group):
        """`src`'s picklable `obj` on every member (control plane)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        self._count(src, len(pickle.dumps(box[0])), "control")
        return box[0]

    def exchange(
        self,
        send: torch.Tensor | tuple[torch.Tensor, ...],
        dst: int,
        src: int,
        recv_shape: Sequence[int] | tuple[Sequence[int], ...],
        group,
        purpose: str = "attention",
    ) -> PendingRecv:
        """Post send(send -> dst) and recv(src) together and return at once (overlap with compute).

        `send` a tensor and `recv_shape` its shape at `src`, or a tuple of tensors (K and V: no
        copy into one message) and a tuple of shapes. Every rank of a ring calls this in the
        same step, so sends and receives pair up (in tuple order).
        """
        single = isinstance(send, torch.Tensor)
        sends = (send,) if single else tuple(send)
        shapes = (recv_shape,) if single else tuple(recv_shape)
        buffers = tuple(
            torch.empty(tuple(shape), dtype=t.dtype, device=t.device) for t, shape in zip(sends, shapes, strict=True)
        )
        ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group=group) for t in sends]
        ops += [dist.P2POp(dist.irecv, buffer, src, group=group) for buffer in buffers]
        with region("exchange"):
            works = dist.batch_isend_irecv(ops)
        self._count(src, sum(b.numel() * b.element_size() for b in buffers), purpose)
        return PendingRecv(works, buffers, single)

    def one_way(
        self, tensor: torch.Tensor | None, src: int, dst: int, shape, dtype, device, group, purpose: str
    ) -> torch.Tensor | None:
        """Blocking point-to-point: `src` sends `tensor`, `dst` returns what it received.

        A batch of one op rather than `dist.send`: NCCL gives a lone send/recv its own
        two-rank communicator, created lazily at first use (mid-step, while other
        communicators may have work in flight); a batched op uses the group's communicator,
        which the mesh created and warmed up."""
        if self.mesh.rank == src:
            op = dist.P2POp(dist.isend, tensor.contiguous(), dst, group=group)
            with region("exchange"):
                for work in dist.batch_isend_irecv([op]):
                    work.wait()
            return None
        buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
        with region("exchange"):
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, src, group=group)]):
                work.wait()
        self._count(src, buffer.numel() * buffer.element_size(), purpose)
        return buffer

    def all_to_all(
        self,
        send_NX: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group_ranks: Sequence[int],
        group,
        purpose: str = "attention",
    ) -> torch.Tensor:
        """Uneven all-to-all along dim 0: rows [sum(send_splits[:j]), ...) go to group member j."""
        recv = send_NX.new_empty((sum(recv_splits), *send_NX.shape[1:]))
        with region("exchange"):
            dist.all_to_all_single(recv, send_NX.contiguous(), recv_splits, send_splits, group=group)
        row = send_NX[0].numel() * send_NX.element_size() if send_NX.shape[0] else 0
        for peer, n in zip(group_ranks, recv_splits, strict=True):
            self._count(peer, n * row, purpose)
        return recv

    def all_gather_seq(
        self, x_BSX: torch.Tensor, sizes: list[int], group_ranks: Sequence[int], group, purpose: str = "gather"
    ) -> torch.Tensor:
        """Concatenate every member's [B, S_j, ...] shard along dim 1 (uneven S_j allowed).

        Shards are padded to the largest size for the collective and trimmed after; the
        counters record the padded bytes, which is what moves.
        """
        longest = max(sizes)
        pad = longest - x_BSX.shape[1]
        padded = torch.nn.functional.pad(x_BSX, (0, 0) * (x_BSX.dim() - 2) + (0, pad)) if pad else x_BSX
        parts = [torch.empty_like(padded) for _ in sizes]
        with region("exchange"):
            dist.all_gather(parts, padded.contiguous(), group=group)
        nbytes = padded.numel() * padded.element_size()
        for peer in group_ranks:
            self._count(peer, nbytes, purpose)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=1)
