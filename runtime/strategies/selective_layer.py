"""One layer of a DiTango step (runtime/strategies/selective.py keeps the state across steps):
the own chunk, the own group's ring and each computed remote group (its chunks fetched from
the rank I*d ahead, the next fetch in flight while the current group's ring runs) fresh, the
units the plan reuses read from the state cache, all merged; then the planner's statistics
measured and the computed units cached.

Shape legend: B batch, S local query tokens, H heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.kernels import attention
from runtime.profiling import region
from runtime.state import AttentionState, merge, merge_all
from runtime.strategies.ring import ring_attention


def selective_layer(rt, layer: int, q_BSHD, k_BSHD, v_BSHD, scale: float, seq_sizes: Sequence[int]) -> AttentionState:
    """Attention of the local queries over the whole sequence under the step's plan of `rt`
    (a SelectiveRuntime): the own chunk and the computed units fresh, the rest from the cache;
    the planner's statistics measured and the computed units cached."""
    plan = rt.step_plan
    assert plan is not None and rt.cache is not None
    rt.control_device = q_BSHD.device
    mesh = rt.mesh
    cp = len(mesh.cp_ranks)
    c = mesh.cp_index
    g, i = divmod(c, rt.group_size)

    def group_sizes(group: int) -> list[int]:
        return [seq_sizes[(group % rt.groups) * rt.group_size + j] for j in range(rt.group_size)]

    def group_state(qk, kk, vv, group: int, include_own: bool = True) -> AttentionState:
        if rt.group_size == 1:
            return attention(qk, kk, vv, scale, rt.backend)
        return ring_attention(
            qk,
            kk,
            vv,
            scale=scale,
            backend=rt.backend,
            comm=rt.comm,
            ring_ranks=mesh.near_ranks,
            ring_group=mesh.near_group,
            kv_sizes=group_sizes(group),
            include_own=include_own,
        )

    units = rt.unit_list
    compute_U = plan.compute_LU[layer].tolist() if plan.kind == "selective" else [True] * len(units)
    offsets = [d for u, offs in enumerate(units) if compute_U[u] for d in offs if d > 0]
    rt.ran_NL[rt.branch, layer] = True
    own_computed = not rt.own_unit or compute_U[0]  # the own group whole, or the own chunk only
    fresh_groups = {(g + d) % rt.groups for d in offsets} | ({g} if own_computed else set())
    fresh_tokens = sum(sum(group_sizes(x)) for x in fresh_groups) + (0 if own_computed else seq_sizes[c])
    rt.kv_fresh += fresh_tokens / sum(seq_sizes)
    rt.evaluations += 1

    B, _, H, D = k_BSHD.shape

    def fetch(d: int):
        # Symmetric: every rank sends its own chunk back by I*d and receives from I*d ahead.
        src_index = (c + rt.group_size * d) % cp
        shape = (B, seq_sizes[src_index], H, D)
        return rt.comm.exchange(
            (k_BSHD, v_BSHD),
            dst=mesh.cp_ranks[(c - rt.group_size * d) % cp],
            src=mesh.cp_ranks[src_index],
            recv_shape=(shape, shape),
            group=mesh.cp_group,
        )

    fresh: dict[int, AttentionState] = {}
    # A fetch (cp communicator) is in flight while the group ring (group communicator) runs:
    # two communicators used at once, which NCCL allows when every rank issues their
    # operations in the same order. Here every rank posts the fetch first, then its group
    # ring, at every offset; both communicators exist since the mesh's warm-up.
    pending = fetch(offsets[0]) if offsets else None  # in flight while the own group computes
    if rt.own_unit:
        local = attention(q_BSHD, k_BSHD, v_BSHD, scale, rt.backend)  # the own chunk
        if compute_U[0]:
            fresh[0] = group_state(q_BSHD, k_BSHD, v_BSHD, g, include_own=False)
    else:
        local = group_state(q_BSHD, k_BSHD, v_BSHD, g)
    for n, d in enumerate(offsets):
        block = pending.wait()
        pending = fetch(offsets[n + 1]) if n + 1 < len(offsets) else None  # prefetch
        fresh[d] = group_state(q_BSHD, *block, g + d)

    with region("bookkeeping"):
        cached = {u: rt.cache.get(rt.branch, layer, u) for u in range(len(units)) if not compute_U[u]}
    unit_states = [merge_all([fresh[d] for d in offs]) if compute_U[u] else cached[u] for u, offs in enumerate(units)]
    out = local
    for state in unit_states:
        out = merge(out, state)
    with region("bookkeeping"):
        rt.stats.measure(
            rt.branch,
            layer,
            plan,
            local,
            unit_states,
            compute_U,
            out,
            lambda u: rt.cache.get(rt.branch, layer, u),
        )
        if plan.kind != "exact" or rt.planner.keeps_exact_states:
            for u in range(len(units)):
                if compute_U[u]:
                    rt.cache.put(rt.branch, layer, u, unit_states[u])
    return out
