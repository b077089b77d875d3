"""Install context parallelism on a diffusers `WanTransformer3DModel` without forking it.

Shape legend: B batch, S tokens (local chunk), H heads, D head dim, C channels.

Three forward hooks and one attention processor:
- `rope` output (cos, sin) [1, S_full, 1, D] -> this rank's chunk (positions stay global);
- `blocks[0]` input hidden states [B, S_full, C] -> this rank's chunk;
- self-attention (`attn1` of every block) -> `ContextParallelProcessor`: projections, QK
  norm and rotary on the local chunk, then the strategy's attention over all chunks;
  cross-attention (`attn2`) keeps diffusers' processor: local queries, full text keys;
- `proj_out` output [B, S_local, C] -> gathered over the cp group, so every rank
  unpatchifies the full prediction and steps its scheduler identically.
Everything else in a Wan block is per token, so it runs unchanged on the local chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.ditango import DiTangoOptions
from planner.layout import chunk_bounds, chunk_sizes, token_count
from runtime.comm import Comm
from runtime.kernels import Backend, attention
from runtime.mesh import Mesh
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

    # -- hooks -------------------------------------------------------------------------
    def shard_rope(self, module, args, output):
        cos, sin = output  # [1, S_full, 1, D], float64 in diffusers' Wan rope
        self.seq_sizes = chunk_sizes(cos.shape[1], self.cp)
        a, b = self.local_bounds()
        # float32 once per forward here, rather than q and k promoted to float64 in every layer
        # (float64 is slow on GPUs; the angles' float32 rounding is far below bf16's).
        return cos[:, a:b].float(), sin[:, a:b].float()

    def shard_hidden(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        assert hidden.shape[1] == sum(self.seq_sizes), "rope and hidden states disagree on the token count"
        a, b = self.local_bounds()
        if args:
            return (hidden[:, a:b], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden[:, a:b]}

    def gather_output(self, module, args, output):
        if self.cp == 1:
            return output
        return self.comm.all_gather_seq(output, self.seq_sizes, self.mesh.cp_ranks, self.mesh.cp_group)

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


def apply_rotary(x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the position angles; Wan's convention.

    cos/sin [1, S, 1, D] hold each angle twice (interleaved), so even lanes carry it.
    Computed in the frequency dtype (float64 in diffusers' Wan rope), then cast back.
    """
    x_even, x_odd = x_BSHD.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    rotated = torch.stack([x_even * c - x_odd * s, x_even * s + x_odd * c], dim=-1).flatten(-2)
    return rotated.to(x_BSHD.dtype)


class ContextParallelProcessor:
    """Self-attention processor for Wan blocks under context parallelism."""

    def __init__(self, ctx: ShardContext, layer: int) -> None:
        self.ctx = ctx
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        assert encoder_hidden_states is None and attention_mask is None, "installed on self-attention only"
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)  # per token (RMS across heads): shard-safe
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        out = self.ctx.attention(query, key, value, scale=query.shape[-1] ** -0.5, layer=self.layer)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@dataclass
class Parallelized:
    """Handles to undo `parallelize_wan` (tests swap strategies on one model), and the
    denoising loop's listener: DiTango needs to know the run, step and CFG branch."""

    ctx: ShardContext
    handles: list
    processors: list
    patch: tuple[int, int, int] = (1, 2, 2)

    def begin_run(self, latents_BCFHW: torch.Tensor, steps: int, branches: int) -> None:
        if self.ctx.selective is None:
            return
        sizes = chunk_sizes(token_count(tuple(latents_BCFHW.shape[2:]), self.patch), self.ctx.cp)
        self.ctx.selective.begin_run(
            max(sizes), latents_BCFHW.shape[0], steps, branches, latents_BCFHW.device,
            local_tokens=sizes[self.ctx.mesh.cp_index],
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

    def remove(self, transformer) -> None:
        for handle in self.handles:
            handle.remove()
        for block, processor in zip(transformer.blocks, self.processors, strict=True):
            block.attn1.set_processor(processor)


def parallelize_wan(
    transformer, mesh: Mesh, comm: Comm, backend: Backend, ditango: DiTangoOptions | None = None
) -> Parallelized:
    ctx = ShardContext(mesh, comm, backend)
    if mesh.layout.strategy == "ditango":
        opts = ditango or DiTangoOptions()
        cfg = transformer.config
        ctx.selective = SelectiveRuntime(
            mesh, comm, backend, opts.planner, layers=cfg.num_layers, heads=cfg.num_attention_heads,
            head_dim=cfg.attention_head_dim, cache_dtype=None if opts.cache_dtype is None else CACHE_DTYPES[opts.cache_dtype],
            cache_limit_bytes=opts.cache_limit_bytes,
        )  # fmt: skip
    handles = [
        transformer.rope.register_forward_hook(ctx.shard_rope),
        transformer.blocks[0].register_forward_pre_hook(ctx.shard_hidden, with_kwargs=True),
        transformer.proj_out.register_forward_hook(ctx.gather_output),
    ]
    processors = [block.attn1.processor for block in transformer.blocks]
    for layer, block in enumerate(transformer.blocks):
        block.attn1.set_processor(ContextParallelProcessor(ctx, layer))
    return Parallelized(ctx, handles, processors, tuple(transformer.config.patch_size))
