"""Install context parallelism on diffusers transformers without forking them.

Shape legend: B batch, S tokens (local chunk), H heads, D head dim, C channels.

The model family's adapter (runtime/models/families.py) decides where tokens enter and are
sharded, which inputs are per token, which modules are self-attention and where the output
is gathered; this module holds what every family shares: the chunking of the token sequence
over the cp group (`ShardContext`) and the strategy's attention of the local queries over all
chunks. Several transformers (Wan2.2's two experts) share one context: one runs at a time.
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
from runtime.state import AttentionState
from runtime.strategies.ring import ring_attention
from runtime.strategies.selective import CACHE_DTYPES, SelectiveRuntime
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
    def attention(self, q_BSHD, k_BSHD, v_BSHD, scale: float, layer: int = 0) -> torch.Tensor:
        """Attention of the local queries over the whole sequence; returns [B, S, H, D] in q's dtype.

        Exact for ring/ulysses/usp; DiTango follows its plan for this step and layer.
        """
        if self.selective is not None:
            state = self.selective.attention(layer, q_BSHD, k_BSHD, v_BSHD, scale, self.seq_sizes)
            return state.out_BSHD.to(q_BSHD.dtype)
        mesh, comm = self.mesh, self.comm
        u, r = mesh.layout.ulysses, mesh.layout.ring
        if self.cp == 1:
            return attention(q_BSHD, k_BSHD, v_BSHD, scale, self.backend).out_BSHD.to(q_BSHD.dtype)
        cp_index = mesh.cp_index
        uly_me = cp_index % u
        ring_me = cp_index // u
        # Ulysses group = cp indices [ring_me * u, (ring_me + 1) * u): their chunk sizes.
        uly_sizes = self.seq_sizes[ring_me * u : (ring_me + 1) * u]
        if u > 1:
            qkv = seq_to_heads(
                torch.stack([q_BSHD, k_BSHD, v_BSHD], dim=2), uly_sizes, comm, mesh.ulysses_ranks, mesh.ulysses_group
            )
            q_BSHD, k_BSHD, v_BSHD = qkv.unbind(dim=2)
        if r > 1:
            spans = [sum(self.seq_sizes[i * u : (i + 1) * u]) for i in range(r)]
            state: AttentionState = ring_attention(
                q_BSHD, k_BSHD, v_BSHD, scale=scale, backend=self.backend, comm=comm,
                ring_ranks=mesh.ring_ranks, ring_group=mesh.ring_group, kv_sizes=spans,
            )  # fmt: skip
        else:
            state = attention(q_BSHD, k_BSHD, v_BSHD, scale, self.backend)
        out = state.out_BSHD.to(q_BSHD.dtype)
        if u > 1:
            out = heads_to_seq(out, uly_sizes, uly_me, comm, mesh.ulysses_ranks, mesh.ulysses_group)
        return out


@dataclass
class Parallelized:
    """Handles to undo `parallelize` (tests swap strategies on one model), and the denoising
    loop's listener: DiTango needs to know the run, step, CFG branch and expert switches."""

    ctx: ShardContext
    transformers: list
    installed: list  # per transformer: (adapter, handles, processors)
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
        for transformer, (adapter, handles, processors) in zip(self.transformers, self.installed, strict=True):
            adapter.uninstall(transformer, handles, processors)


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
    if mesh.layout.strategy == "ditango":
        opts = ditango or DiTangoOptions()
        layers, heads, head_dim = shapes.pop()
        ctx.selective = SelectiveRuntime(
            mesh, comm, backend, opts.planner, layers=layers, heads=heads, head_dim=head_dim,
            cache_dtype=None if opts.cache_dtype is None else CACHE_DTYPES[opts.cache_dtype],
            cache_limit_bytes=opts.cache_limit_bytes,
        )  # fmt: skip
    installed = [(a, *a.install(t, ctx)) for a, t in zip(adapters, transformers, strict=True)]
    return Parallelized(ctx, transformers, installed, patches.pop())
