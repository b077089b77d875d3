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

import contextlib
from dataclasses import dataclass, field
from importlib import import_module

import torch

from planner.ditango import DiTangoOptions
from planner.layout import chunk_bounds, chunk_sizes
from runtime.comm import Comm
from runtime.compile import register
from runtime.kernels import Backend, attention
from runtime.mesh import Mesh
from runtime.models.families import family_of
from runtime.state import AttentionState, merge_all
from runtime.strategies.exact import EXACT


@dataclass
class ShardContext:
    """Per-model parallel state shared by the hooks and processors (reset per forward).
    `strategy`: how the local queries attend the whole sequence (`attend(ctx, q, k, v, scale,
    layer, extra_kv)`): the exact composition, or DiTango's runtime."""

    mesh: Mesh
    comm: Comm
    backend: Backend
    strategy: object = EXACT
    seq_sizes: list[int] = field(default_factory=list)  # cp chunk sizes of the current forward
    handle: int = 0  # what a compiled block's ops find this context by (runtime/compile.py)

    def __post_init__(self) -> None:
        self.handle = register(self)

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
        return self.strategy.attend(self, q_BSHD, k_BSHD, v_BSHD, scale, layer, extra_kv)

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
        text = attention(q_BLHD, k_BLHD, v_BLHD, scale, self.backend)
        return chunk, merge_all([*self._chunk_states(q_BLHD, k_BSHD, v_BSHD, scale), text]).out_BSHD.to(q_BLHD.dtype)

    def whole_query_attention(self, q_BLHD, k_BSHD, v_BSHD, scale: float) -> torch.Tensor:
        """Queries every rank holds whole ([B, L, H, D]: LTX-2's audio) over the keys of every
        chunk (this rank's [B, S, H, D]): each rank's state over its own chunk, all-gathered over
        the cp group and merged in cp order, so the rows are bit-identical on every rank. Returns
        [B, L, H, D] in q's dtype."""
        return merge_all(self._chunk_states(q_BLHD, k_BSHD, v_BSHD, scale)).out_BSHD.to(q_BLHD.dtype)

    def _chunk_states(self, q_BLHD, k_BSHD, v_BSHD, scale: float) -> list[AttentionState]:
        """The whole-held queries' states over each rank's chunk, in cp order (always fresh:
        DiTango's reuse never reaches them)."""
        own = attention(q_BLHD, k_BSHD, v_BSHD, scale, self.backend)
        if self.cp == 1:
            return [own]
        mesh, L = self.mesh, q_BLHD.shape[1]
        packed = torch.cat([own.out_BSHD, own.lse_BSH.unsqueeze(-1)], dim=-1)  # [B, L, H, D + 1]
        every = self.comm.all_gather_seq(packed, [L] * self.cp, mesh.cp_ranks, mesh.cp_group, purpose="joint")
        return [
            AttentionState(part[..., :-1].contiguous(), part[..., -1].contiguous()) for part in every.split(L, dim=1)
        ]


@dataclass
class Parallelized:
    """Handles to undo `parallelize` (tests swap strategies on one model), and DiTango's runtime
    when it is the strategy (it listens to the denoising loop: runtime/denoiser.py)."""

    ctx: ShardContext
    transformers: list
    installed: list  # per transformer: (the adapter's uninstall, handles, what it replaced)
    ditango: object | None = None  # a reusing strategy's runtime (runtime/strategies/selective.py)

    @contextlib.contextmanager
    def exact(self):
        """The exact composition over the cp group meanwhile (DiTango's exact runs: the ring)."""
        strategy, self.ctx.strategy = self.ctx.strategy, EXACT
        try:
            yield self
        finally:
            self.ctx.strategy = strategy

    def remove(self) -> None:
        """Undo the install (under tp a collective: every rank of the group removes)."""
        for transformer, (uninstall, handles, replaced) in zip(self.transformers, self.installed, strict=True):
            uninstall(transformer, handles, replaced)


def parallelize(
    transformers, mesh: Mesh, comm: Comm, backend: Backend, ditango: DiTangoOptions | None = None
) -> Parallelized:
    """Install the layout's strategy on a transformer, or on several that take turns (experts)
    and share one context (and one runtime: the same attention shape is required). The
    strategy's runtime module (planner/strategy.py `runtime`) builds what does its work: the
    attention the context routes to, or for a weight-splitting strategy what the families'
    `install_tp` splits the blocks with."""
    transformers = list(transformers) if isinstance(transformers, (list, tuple)) else [transformers]
    families = [family_of(t) for t in transformers]
    shapes = {f.attention_shape(t) for f, t in zip(families, transformers, strict=True)}
    patches = {f.patch_size(t) for f, t in zip(families, transformers, strict=True)}
    assert len(shapes) == 1 and len(patches) == 1, f"experts differ in attention shape or patch: {shapes}, {patches}"
    ctx = ShardContext(mesh, comm, backend)
    strategy = mesh.layout.strategy
    built = import_module(strategy.runtime).build(ctx, transformers, ditango)
    if strategy.splits_weights:
        installed = [(f.uninstall_tp, *f.install_tp(t, built)) for f, t in zip(families, transformers, strict=True)]
        return Parallelized(ctx, transformers, installed)
    ctx.strategy = built
    installed = [(f.uninstall, *f.install(t, ctx)) for f, t in zip(families, transformers, strict=True)]
    return Parallelized(ctx, transformers, installed, built if strategy.reuses else None)
