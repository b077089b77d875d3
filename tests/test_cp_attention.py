"""Distributed attention parity (gloo, 2-4 processes) and byte counters vs analytic volume."""

from __future__ import annotations

import itertools

import pytest
import torch

from planner.layout import ParallelLayout, chunk_sizes, virtual_node_map
from runtime.comm import Comm
from runtime.kernels import reference_attention
from runtime.mesh import build_mesh
from runtime.strategies import ShardContext
from slurm.launchers.processes import run_ranks

ATOL = 1e-5  # the bound for attention-level parity
TIMEOUT_S = 60
B, H, D = 2, 12, 8  # 12 heads: Ulysses 2, 3, 4 and USP 2x2 all legal


def cases(world: int) -> list[tuple[str, int | None, int]]:
    """(strategy, ulysses degree for usp, token count): even and uneven lengths."""
    out = []
    for S in (8 * world, 8 * world + 3, 2 * world + 1):
        out.append(("ring", None, S))
        out.append(("ulysses", None, S))
        if world == 4:
            out.append(("usp", 2, S))
    return out


def _target(rank, world, events, nodes):
    results, meshes = [], {}
    for strategy, ulysses, S in cases(world):
        layout = ParallelLayout(nodes=nodes, gpus_per_node=world // nodes, strategy=strategy, ulysses_degree=ulysses)
        if layout not in meshes:  # group creation is collective and slow-ish: once per layout
            meshes[layout] = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(meshes[layout])
        g = torch.Generator().manual_seed(S)
        q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
        ctx = ShardContext(meshes[layout], comm, "sdpa")
        ctx.seq_sizes = chunk_sizes(S, world)
        a, b = ctx.local_bounds()
        out = ctx.attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=D**-0.5)
        ref = reference_attention(q, k, v, D**-0.5)[0][:, a:b]
        err = (out.double() - ref).abs().max().item()
        assert err <= ATOL, (strategy, S, rank, err)
        results.append((strategy, S, comm.totals(), err))
    return results


def kv_bytes(tokens: int) -> int:
    return 2 * B * tokens * H * D * 4  # K and V, fp32


@pytest.mark.distributed
@pytest.mark.parametrize("world,nodes", [(2, 1), (3, 1), (4, 2)])
def test_exact_attention_and_byte_counts(world, nodes):
    per_rank = run_ranks(_target, world, (nodes,), timeout_s=TIMEOUT_S)
    for case, (parallel, _, S) in enumerate(cases(world)):
        sizes = chunk_sizes(S, world)
        totals = [per_rank[rank][case][2] for rank in range(world)]
        for rank, t in enumerate(totals):
            got = t["intra_node_bytes"] + t["inter_node_bytes"]
            if parallel == "ring":
                # Each rank receives K and V of every other chunk once.
                assert got == sum(kv_bytes(n) for j, n in enumerate(sizes) if j != rank)
            elif parallel == "ulysses":
                # In: q, k, v of the other ranks' chunks for our heads; back: our chunk, their heads.
                h = H // world
                qkv_in = sum(3 * B * n * h * D * 4 for j, n in enumerate(sizes) if j != rank)
                assert got == qkv_in + (world - 1) * B * sizes[rank] * h * D * 4
            else:  # usp 2x2: Ulysses inside a node (pairs 0-1, 2-3), ring across nodes (0-2, 1-3)
                h, mate = H // 2, rank ^ 1
                span_other = sum(sizes[2:]) if rank < 2 else sum(sizes[:2])
                uly = 3 * B * sizes[mate] * h * D * 4 + B * sizes[rank] * h * D * 4  # qkv in, output back
                ring = 2 * B * span_other * h * D * 4  # K and V of the other ring member's span
                assert (t["intra_node_bytes"], t["inter_node_bytes"]) == (uly, ring)
        inter = [t["inter_node_bytes"] for t in totals]
        if nodes == 1:
            assert sum(inter) == 0
        elif parallel == "ring":
            # Ring 0->1->2->3->0 over nodes {0,1} | {2,3}: ranks 0 and 2 receive across nodes.
            assert [n > 0 for n in inter] == [True, False, True, False]


def _warm_up_target(rank, world, events):
    import torch.distributed as dist

    touched, real = [], dist.all_reduce

    def spy(tensor, *args, group=None, **kwargs):
        touched.append(group)
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = spy
    try:
        layout = ParallelLayout(nodes=2, gpus_per_node=2, cfg_degree=2, strategy="ditango", group_size=1)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    finally:
        dist.all_reduce = real
    groups = {k: getattr(mesh, f"{k}_group") for k in ("cp", "ulysses", "ring", "near", "cfg", "world", "control")}
    # P2P of one op goes through a batch (the group's communicator), never a lone send/recv.
    lone = []
    dist.send, dist.recv = (lambda *a, **k: lone.append("send")), (lambda *a, **k: lone.append("recv"))
    comm = Comm(mesh)
    partner = mesh.cfg_ranks[1 - mesh.cfg_index]
    got = comm.one_way(
        torch.full((3,), float(rank)) if mesh.cfg_index == 0 else None,
        mesh.cfg_ranks[0],
        mesh.cfg_ranks[1],
        (3,),
        torch.float32,
        "cpu",
        mesh.cfg_group,
        "cfg",
    )
    return {k: g is not None and g in touched for k, g in groups.items() if g is not None}, got, partner, lone


@pytest.mark.distributed
def test_build_mesh_warms_up_every_communicator_and_p2p_is_batched():
    """Communicators are created eagerly (a collective on each of a rank's groups inside
    build_mesh) so that none is created lazily inside a step; single P2P uses batch_isend_irecv."""
    per_rank = run_ranks(_warm_up_target, 4, (), timeout_s=TIMEOUT_S)
    for rank, (warmed, got, partner, lone) in enumerate(per_rank):
        # cfg 2 x cp 2: cp, ring, cfg, world (ring = cp here) and the gloo control group exist.
        assert warmed and all(warmed.values()), (rank, warmed)
        assert {"cp", "ring", "cfg", "world", "control"} <= set(warmed)
        assert lone == []
        if rank >= 2:  # the cfg-1 side received from its cfg-0 partner
            assert torch.equal(got, torch.full((3,), float(partner)))


L_TEXT = 5  # tokens every rank holds whole (a joint model's text)


def _joint_target(rank, world, events, nodes):
    results, meshes = [], {}
    for strategy, ulysses, S in cases(world):
        layout = ParallelLayout(nodes=nodes, gpus_per_node=world // nodes, strategy=strategy, ulysses_degree=ulysses)
        if layout not in meshes:
            meshes[layout] = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        mesh = meshes[layout]
        g = torch.Generator().manual_seed(S + 100)
        q, k, v = (torch.randn(B, S + L_TEXT, H, D, generator=g) for _ in range(3))  # video first, then text
        ctx = ShardContext(mesh, Comm(mesh), "sdpa")
        ctx.seq_sizes = chunk_sizes(S, world)
        a, b = ctx.local_bounds()
        text = slice(S, S + L_TEXT)
        chunk, whole = ctx.joint_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], q[:, text], k[:, text], v[:, text], scale=D**-0.5
        )
        ref = reference_attention(q, k, v, D**-0.5)[0]
        chunk_err = (chunk.double() - ref[:, a:b]).abs().max().item()
        text_err = (whole.double() - ref[:, text]).abs().max().item()
        results.append((strategy, S, chunk_err, text_err, whole))
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("world,nodes", [(2, 1), (3, 1), (4, 2)])
def test_joint_attention_with_whole_held_tokens(world, nodes):
    """Sharded video tokens and text tokens held whole on every rank: both kinds of rows exact,
    and the text rows bit-identical on every rank (each rank merges the same gathered states)."""
    per_rank = run_ranks(_joint_target, world, (nodes,), timeout_s=TIMEOUT_S)
    for case, (strategy, _, S) in enumerate(cases(world)):
        for rank in range(world):
            _, _, chunk_err, text_err, whole = per_rank[rank][case]
            assert chunk_err <= ATOL and text_err <= ATOL, (strategy, S, rank, chunk_err, text_err)
            assert torch.equal(whole, per_rank[0][case][4]), (strategy, S, rank)


@pytest.mark.parametrize("parallel,cfg", [("ring", 1), ("ditango", 2), ("usp", 1), ("tp", 1)])
def test_one_communicator_per_distinct_rank_set_warmed_once(monkeypatch, parallel, cfg):
    """Bug: kinds with the same members (cp, ring and world for a ring without CFG) were each
    their own communicator, each warmed: under NCCL every one holds its own GPU buffers."""
    import runtime.mesh as mesh_mod

    created, reduced = [], []
    monkeypatch.setattr(mesh_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(
        mesh_mod.dist, "new_group", lambda ranks, **kw: created.append((tuple(ranks), kw.get("backend"))) or object()
    )
    sizes = {}

    def all_reduce(tensor, group=None):
        reduced.append(group)
        tensor.fill_(sizes.get(id(group), 8))

    monkeypatch.setattr(mesh_mod.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(mesh_mod.dist, "get_world_size", lambda group: sizes.get(id(group), 8))
    extra = {"ulysses_degree": 2} if parallel == "usp" else {}
    layout = ParallelLayout(nodes=2, gpus_per_node=4, cfg_degree=cfg, strategy=parallel, **extra)
    for rank in range(layout.world_size):
        created.clear(), reduced.clear()
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        nccl = [m for m, backend in created if backend is None]
        assert len(nccl) == len(set(nccl)), nccl  # one communicator per distinct set of ranks
        mine = {k: getattr(mesh, f"{k}_group") for k in ("cp", "ulysses", "ring", "near", "cfg", "world")}
        members = {k: getattr(mesh, f"{k}_ranks") for k in ("cp", "ulysses", "ring", "near", "cfg")}
        members["world"] = tuple(range(layout.world_size))
        for a, b in itertools.combinations(mine, 2):  # the same members: the same communicator
            if members[a] == members[b] and len(members[a]) > 1:
                assert mine[a] is mine[b], (rank, a, b)
        warmed = [g for g in reduced if g is not mesh.control_group]
        assert len(warmed) == len({id(g) for g in warmed}) == len({id(g) for g in mine.values() if g is not None})
    if parallel == "ring":
        assert mesh.cp_group is mesh.ring_group is mesh.world_group
