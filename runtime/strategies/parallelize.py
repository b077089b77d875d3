"""Install context parallelism on diffusers transformers without forking them.

Shape legend: B batch, S tokens (local chunk), H heads, D head dim, C channels.

The model family's adapter (runtime/models/families.py) decides where tokens enter and are
sharded, which inputs are per token, which modules are self-attention and where the output
is gathered; this module holds what every family shares: the chunking of the token sequence
over the cp group (`ShardContext`) and the strategy's attention of the local queries over all
chunks. Several transformers (Wan2.2's two experts) share one context: one runs at a time.
Tensor parallelism (`tp`) shards no tokens: the adapter's `install_tp` splits the blocks'
weights over the cp group (runtime/strategies/tensor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.ditango import DiTangoOptions
from planner.layout import chunk_bounds, chunk_sizes, token_count
from runtime.comm import Comm
from runtime.kernels import Backend, attention
from runtime.mesh import Mesh
from runtime.models.families import adapter_for
from runtime.state import AttentionState, merge, merge_all
from runtime.strategies.ring import ring_attention
from runtime.strategies.selective import CACHE_DTYPES, SelectiveRuntime
from runtime.strategies.tensor import TensorParallel, check_unsharded
from runtime.strategies.ulysses import heads_to_seq, seq_to_heads


@dataclass
class ShardContext:
    """Per-model parallel state shared by the hooks and processors (reset per forward)."""

    mesh: Mesh
    comm: Comm
    backend: Backend
    seq_sizes: list[int] = field(default_factory=list)  # cp chunk sizes of the current forward
    selective: SelectiveRuntime | None = None  # DiTango's runtime side, for --parallel ditango

    @property
    def cp(self) -> int:
        return len(self.mesh.cp_ranks)

    def local_bounds(self) -> tuple[int, int]:
        return chunk_bounds(self.seq_sizes, self.mesh.cp_index)

    # -- token chunks (called by the family adapter's hooks) ---------------------------
    @property
    def tokens(self) -> int:
        return sum(self.seq_sizes)

    def begin_forward(self, tokens: int) -> None:
        """A forward over `tokens` tokens starts: chunk them over the cp group."""
        self.seq_sizes = chunk_sizes(tokens, self.cp)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunk of a per-token tensor (tokens on `dim`)."""
        a, b = self.local_bounds()
        return x.narrow(dim, a, b - a)

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """The whole sequence [B, S_full, ...] from every rank's chunk [B, S_local, ...]."""
        if self.cp == 1:
            return x_local
        return self.comm.all_gather_seq(x_local, self.seq_sizes, self.mesh.cp_ranks, self.mesh.cp_group)

    # -- attention ---------------------------------------------------------------------
    def attention(
        self, q_BSHD, k_BSHD, v_BSHD, scale: float, layer: int = 0, extra_kv: tuple | None = None
    ) -> torch.Tensor:
        """Attention of the local queries over the whole sequence; returns [B, S, H, D] in q's dtype.

        Exact for ring/ulysses/usp; DiTango follows its plan for this step and layer.
        `extra_kv`: (k, v) [B, L, H, D] held whole on every rank (a joint model's text tokens):
        a partition every query also attends, computed fresh here (never sent, never reused).
        """
        if self.selective is not None:
            state = self.selective.attention(layer, q_BSHD, k_BSHD, v_BSHD, scale, self.seq_sizes)
            return self._with_extra(state, q_BSHD, extra_kv, scale).out_BSHD.to(q_BSHD.dtype)
        mesh, comm = self.mesh, self.comm
        u, r = mesh.layout.ulysses, mesh.layout.ring
        if self.cp == 1:
            state = attention(q_BSHD, k_BSHD, v_BSHD, scale, self.backend)
            return self._with_extra(state, q_BSHD, extra_kv, scale).out_BSHD.to(q_BSHD.dtype)
        cp_index = mesh.cp_index
        uly_me = cp_index % u
        ring_me = cp_index // u
        # Ulysses group = cp indices [ring_me * u, (ring_me + 1) * u): their chunk sizes.
        uly_sizes = self.seq_sizes[ring_me * u : (ring_me + 1) * u]
        dtype = q_BSHD.dtype
        if u > 1:
            qkv = seq_to_heads(
                torch.stack([q_BSHD, k_BSHD, v_BSHD], dim=2), uly_sizes, comm, mesh.ulysses_ranks, mesh.ulysses_group
            )
            q_BSHD, k_BSHD, v_BSHD = qkv.unbind(dim=2)
            if extra_kv is not None:  # this member's heads of the whole-held partition (seq_to_heads' split)
                h = q_BSHD.shape[2]
                extra_kv = tuple(t[:, :, uly_me * h : (uly_me + 1) * h] for t in extra_kv)
        if r > 1:
            spans = [sum(self.seq_sizes[i * u : (i + 1) * u]) for i in range(r)]
            state: AttentionState = ring_attention(
                q_BSHD, k_BSHD, v_BSHD, scale=scale, backend=self.backend, comm=comm,
                ring_ranks=mesh.ring_ranks, ring_group=mesh.ring_group, kv_sizes=spans,
            )  # fmt: skip
        else:
            state = attention(q_BSHD, k_BSHD, v_BSHD, scale, self.backend)
        out = self._with_extra(state, q_BSHD, extra_kv, scale).out_BSHD.to(dtype)
        if u > 1:
            out = heads_to_seq(out, uly_sizes, uly_me, comm, mesh.ulysses_ranks, mesh.ulysses_group)
        return out

    def _with_extra(self, state: AttentionState, q_BSHD, extra_kv, scale: float) -> AttentionState:
        if extra_kv is None:
            return state
        return merge(state, attention(q_BSHD, *extra_kv, scale, self.backend))

    def joint_attention(
        self, q_BSHD, k_BSHD, v_BSHD, q_BLHD, k_BLHD, v_BLHD, scale: float, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint self-attention of sharded tokens (this rank's chunk, [B, S, H, D]) and tokens
        every rank holds whole (a joint model's text, [B, L, H, D], L at most a few hundred):
        every query attends every key of both. Returns (chunk out, whole out) in q's dtype.

        - The chunk's queries: the strategy's attention over all chunks (`attention`), merged
          with their state over the whole-held keys (`extra_kv`).
        - The whole-held queries: each rank's state over its own chunk only (always fresh, so
          DiTango's reuse never reaches them), all-gathered over the cp group ([B, L, H, D+1]
          per rank) and merged in cp order with their state over the whole-held keys. Every
          rank merges the same numbers in the same order: the rows are bit-identical
          everywhere, and exact (a partition of the keys, merged by (out, lse)).
        """
        chunk = self.attention(q_BSHD, k_BSHD, v_BSHD, scale, layer, extra_kv=(k_BLHD, v_BLHD))
        own = attention(q_BLHD, k_BSHD, v_BSHD, scale, self.backend)
        text = attention(q_BLHD, k_BLHD, v_BLHD, scale, self.backend)
        if self.cp == 1:
            return chunk, merge(own, text).out_BSHD.to(q_BLHD.dtype)
        mesh, L = self.mesh, q_BLHD.shape[1]
        packed = torch.cat([own.out_BSHD, own.lse_BSH.unsqueeze(-1)], dim=-1)  # [B, L, H, D + 1]
        every = self.comm.all_gather_seq(packed, [L] * self.cp, mesh.cp_ranks, mesh.cp_group, purpose="joint")
        states = [
            AttentionState(part[..., :-1].contiguous(), part[..., -1].contiguous()) for part in every.split(L, dim=1)
        ]
        return chunk, merge_all([*states, text]).out_BSHD.to(q_BLHD.dtype)


@dataclass
class Parallelized:
    """Handles to undo `parallelize` (tests swap strategies on one model), and the denoising
    loop's listener: DiTango needs to know the run, step, CFG branch and expert switches."""

    ctx: ShardContext
    transformers: list
    installed: list  # per transformer: (the adapter's uninstall, handles, what it replaced)
    patch: tuple[int, int, int] = (1, 2, 2)

    def begin_run(self, latents_BCFHW: torch.Tensor, steps: int, branches: int, switches: tuple[int, ...] = ()) -> None:
        """`switches`: the steps where another expert takes over (Wan2.2 A14B): DiTango's cached
        states belong to the expert that made them, so such a step is an anchor."""
        if self.ctx.selective is None:
            return
        sizes = chunk_sizes(token_count(tuple(latents_BCFHW.shape[2:]), self.patch), self.ctx.cp)
        self.ctx.selective.begin_run(
            max(sizes), latents_BCFHW.shape[0], steps, branches, latents_BCFHW.device,
            local_tokens=sizes[self.ctx.mesh.cp_index], switches=switches,
        )  # fmt: skip

    def end_run(self) -> None:
        if self.ctx.selective is not None:
            self.ctx.selective.end_run()

    def begin_step(self, step: int) -> None:
        if self.ctx.selective is not None:
            self.ctx.selective.begin_step(step)

    def begin_branch(self, branch: int) -> None:
        if self.ctx.selective is not None:
            self.ctx.selective.begin_branch(branch)

    def end_step(self, step: int) -> None:
        if self.ctx.selective is not None:
            self.ctx.selective.end_step(step)

    def remove(self) -> None:
        """Undo the install (under tp a collective: every rank of the group removes)."""
        for transformer, (uninstall, handles, replaced) in zip(self.transformers, self.installed, strict=True):
            uninstall(transformer, handles, replaced)


def parallelize(
    transformers, mesh: Mesh, comm: Comm, backend: Backend, ditango: DiTangoOptions | None = None
) -> Parallelized:
    """Install the layout's strategy on a transformer, or on several that take turns (experts)
    and share one context (and one DiTango runtime: the same attention shape is required)."""
    transformers = list(transformers) if isinstance(transformers, (list, tuple)) else [transformers]
    adapters = [adapter_for(t) for t in transformers]
    shapes = {a.attention_shape(t) for a, t in zip(adapters, transformers, strict=True)}
    patches = {a.patch_size(t) for a, t in zip(adapters, transformers, strict=True)}
    assert len(shapes) == 1 and len(patches) == 1, f"experts differ in attention shape or patch: {shapes}, {patches}"
    ctx = ShardContext(mesh, comm, backend)
    if mesh.layout.strategy == "tp":
        tp = TensorParallel(mesh, comm, backend)
        installed = []
        for a, t in zip(adapters, transformers, strict=True):
            check_unsharded(t)
            handles, undo = a.install_tp(t, tp)
            installed.append((a.uninstall_tp, handles, undo))
        return Parallelized(ctx, transformers, installed, patches.pop())
    if mesh.layout.strategy == "ditango":
        opts = ditango or DiTangoOptions()
        layers, heads, head_dim = shapes.pop()
        ctx.selective = SelectiveRuntime(
            mesh, comm, backend, opts.planner, layers=layers, heads=heads, head_dim=head_dim,
            cache_dtype=None if opts.cache_dtype is None else CACHE_DTYPES[opts.cache_dtype],
            cache_limit_bytes=opts.cache_limit_bytes,
        )  # fmt: skip
    installed = [(a.uninstall, *a.install(t, ctx)) for a, t in zip(adapters, transformers, strict=True)]
    return Parallelized(ctx, transformers, installed, patches.pop())
