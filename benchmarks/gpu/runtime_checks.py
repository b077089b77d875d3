"""Sections 2 and 4 of benchmarks/gpu_check.py: the runtime's transport and DiTango paths over
a one-rank NCCL world, and DiTango's cache allocated at its target size. Each takes a device
(and backend), so the CPU suite runs what gloo can (tests/test_gpu_check.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from runtime.kernels import reference_attention


@dataclass
class Row:
    section: str
    check: str
    value: float
    limit: str
    ok: bool

    def to_json(self) -> dict:
        return {**self.__dict__, "value": None if math.isnan(self.value) else self.value}


def _rand(shape, dtype, device, g) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def random_wan(config: dict, latent_shape: tuple[int, int, int], text_len: int, dtype: torch.dtype, device: str):
    """(a random-weight Wan transformer of `config` in `dtype` as from_pretrained would leave it,
    its forward on fixed random latents [1, C, F, H, W] and text [1, L, text_dim], no grad)."""
    from diffusers import WanTransformer3DModel

    from runtime.models.meta import cast_like_loader

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    cast_like_loader(model, dtype)  # the parameters diffusers keeps in float32 stay so
    model = model.eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(2)
    latents = _rand((1, config["in_channels"], *latent_shape), dtype, device, g)
    text = _rand((1, text_len, config["text_dim"]), dtype, device, g)
    t = torch.tensor([500.0], device=device)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    return model, forward


# -- 2. NCCL on one rank ------------------------------------------------------------------------
def nccl_rows(device: str = "cuda", backend: str = "nccl") -> list[Row]:
    """One-rank NCCL world, hand-built mesh whose members are all rank 0 (NCCL sends to self).
    `backend` "gloo" on the CPU (the suite): the bring-up and collectives only, gloo having
    no send to self."""
    import tempfile as tf
    from datetime import timedelta

    import torch.distributed as dist

    from planner.ditango import PlannerConfig
    from planner.layout import ParallelLayout
    from planner.plan import StepPlan
    from runtime.comm import Comm
    from runtime.mesh import Mesh, warm_up
    from runtime.strategies.ring import ring_attention
    from runtime.strategies.selective import SelectiveRuntime

    device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rdzv = tf.mktemp(prefix="ditango-gpu-check-")
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=f"file://{rdzv}", rank=0, world_size=1, timeout=timedelta(seconds=60), **bound
    )
    rows = []
    try:
        world = dist.group.WORLD
        control = dist.new_group([0], backend="gloo")

        def mesh_for(layout: ParallelLayout) -> Mesh:
            cp = layout.cp_degree
            return Mesh(
                layout=layout,
                rank=0,
                node_of=(0,) * cp,
                cp_ranks=(0,) * cp,
                ulysses_ranks=(0,),
                ring_ranks=(0,) * cp,
                near_ranks=(0,) * layout.group,
                cfg_ranks=(0,),
                device=device,
                world_group=world,
                control_group=control,
                cp_group=world,
                ulysses_group=None,
                ring_group=world,
                near_group=world if layout.group > 1 else None,
                cfg_group=None,
            )

        ring_mesh = mesh_for(ParallelLayout(nodes=1, gpus_per_node=4, strategy="ring"))
        warm_up(ring_mesh)  # raises on a wrong sum
        rows.append(Row("nccl", "warm-up of every group of a 4-member mesh", 1.0, "1", True))
        comm = Comm(ring_mesh)
        g = torch.Generator(device=device).manual_seed(1)
        B, S, H, D = 1, 1000, 12, 128
        x = _rand((2, B, S, H, D), torch.bfloat16, device, g)
        same = torch.equal(comm.all_gather_seq(x[0], [S], (0,), world), x[0])
        rows.append(Row("nccl", "Comm.all_gather_seq over one rank", float(same), "1", same))
        if backend != "nccl":
            return rows
        same = torch.equal(comm.exchange(x, dst=0, src=0, recv_shape=x.shape, group=world).wait(), x)
        rows.append(Row("nccl", "Comm.exchange (batched P2P) to itself returns the block", float(same), "1", same))

        q, k, v = (_rand((B, S, H, D), torch.bfloat16, device, g) for _ in range(3))
        scale = D**-0.5
        ref_out, ref_lse = reference_attention(q, k, v, scale)
        state = ring_attention(
            q, k, v, scale=scale, backend="sdpa", comm=comm, ring_ranks=(0,) * 4, ring_group=world, kv_sizes=[S] * 4
        )
        out_err = (state.out_BSHD.double() - ref_out).abs().max().item()
        lse_err = (state.lse_BSH.double() - (ref_lse + math.log(4))).abs().max().item()
        rows.append(Row("nccl", "ring over 4 copies: out vs float64", out_err, "<= 0.03", out_err <= 0.03))
        rows.append(Row("nccl", "ring over 4 copies: lse - log 4 vs float64", lse_err, "<= 0.1", lse_err <= 0.1))

        layout = ParallelLayout(nodes=1, gpus_per_node=4, strategy="ditango", group_size=1)  # 4 groups, 3 remote
        dmesh = mesh_for(layout)
        rt = SelectiveRuntime(dmesh, Comm(dmesh), "sdpa", PlannerConfig(warmup=0, cooldown=0), 1, H, D)
        rt.allocate(S, B, steps=4, branches=1, device=device, local_tokens=S)
        units = rt.units
        worst = 0.0
        patterns = [[True] * units, [False] * units, [True, False, True][:units], [False, True, False][:units]]
        for i, bits in enumerate(patterns):
            kind = "anchor" if i == 0 else "selective"
            rt.step_plan = StepPlan(i, kind, torch.tensor([bits]), None if i == 0 else 0.0)
            rt._check_plan_agrees(rt.step_plan)
            out = rt.attention(0, q, k, v, scale, [S] * 4)
            worst = max(worst, (out.out_BSHD.double() - ref_out).abs().max().item())
        rows.append(
            Row("nccl", "DiTango compute/reuse patterns over 4 copies: out vs float64", worst, "<= 0.03", worst <= 0.03)
        )
        rt.end_run()
    finally:
        dist.destroy_process_group()
    return rows


# -- 4. the DiTango cache at its target size ----------------------------------------------------
def held_bytes(rt) -> int:
    """Bytes of every tensor a SelectiveRuntime still holds (its cache's and its own)."""
    own = sum(t.nbytes for t in vars(rt).values() if isinstance(t, torch.Tensor))
    return own + (rt.cache.nbytes() if rt.cache is not None else 0)


# Wan2.1-14B at 1280x720x81 (latent 21 x 90 x 160, patch 2x2: 75,600 tokens) on CP 16.
CACHE_14B = dict(layers=40, heads=40, head_dim=128, tokens=21 * 45 * 80, cp=16, group=2, branches=2)


def cache_rows(device: str = "cuda", shape: dict = CACHE_14B, name: str = "14B 720p CP16") -> list[Row]:
    """On the CPU (the suite: a small `shape`) the buffers are float32 and uncapped, and the
    allocator is not asked: the buffer formula, what the runtime holds and frees are."""
    from planner.ditango import PlannerConfig, unit_offsets
    from planner.layout import ParallelLayout
    from runtime.cache import anchor_bytes, cache_dtype_for, unit_bytes
    from runtime.comm import Comm
    from runtime.mesh import Mesh
    from runtime.strategies.selective import SelectiveRuntime

    device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    cuda = device.type == "cuda"
    layers, heads, head_dim, cp, group, branches = (
        shape[k] for k in ("layers", "heads", "head_dim", "cp", "group", "branches")
    )
    local = shape["tokens"] // cp
    dtype = cache_dtype_for(None, device)
    layout = ParallelLayout(nodes=cp // 8 or 1, gpus_per_node=min(cp, 8), strategy="ditango", group_size=group)
    mesh = Mesh(
        layout=layout,
        rank=0,
        node_of=(0,) * cp,
        cp_ranks=(0,) * cp,
        ulysses_ranks=(0,),
        ring_ranks=(0,) * cp,
        near_ranks=(0,) * group,
        cfg_ranks=(0,),
        device=device,
    )
    units = len(unit_offsets(layout.groups, group, PlannerConfig().own_group))  # the own group's others + remote
    expected = branches * layers * (units * unit_bytes(1, local, heads, head_dim, dtype))
    expected += branches * layers * anchor_bytes(1, local, heads)
    rows = []
    allocated = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    if cuda:
        torch.cuda.empty_cache()
    base = allocated()
    rt = SelectiveRuntime(mesh, Comm(mesh), "sdpa", PlannerConfig(), layers, heads, head_dim)
    start = time.perf_counter()
    rt.allocate(local, 1, steps=50, branches=branches, device=device, local_tokens=local)
    if cuda:
        torch.cuda.synchronize()
    alloc_s = time.perf_counter() - start
    counted = rt.cache.nbytes() + rt.reference_bytes()
    rows.append(
        Row(
            "cache",
            f"{name} {str(dtype)[6:]}: buffers (GB) = formula {expected / 1e9:.3f} GB (k={rt.compose})",
            counted / 1e9,
            f"== {expected / 1e9:.3f}",
            counted == expected and rt.compose == 1,
        )
    )
    if cuda:  # the planner's statistics come on top: a few KiB
        held = allocated() - base
        rows.append(
            Row(
                "cache",
                "GPU memory taken beyond the buffers (bytes)",
                float(held - expected),
                "0..1 MiB",
                0 <= held - expected <= 2**20,
            )
        )
    rows.append(Row("cache", "allocation time (s)", alloc_s, "<= 5", alloc_s <= 5))
    rt.end_run()
    left = held_bytes(rt)
    rows.append(
        Row("cache", "bytes the runtime holds after the item (freed before decode)", float(left), "== 0", left == 0)
    )
    if cuda:
        torch.cuda.empty_cache()
        left = allocated() - base
        rows.append(Row("cache", "GPU bytes left after the item", float(left), "== 0", left == 0))
    cap = expected - branches * layers * units * unit_bytes(1, local, heads, head_dim, dtype) // 2
    capped = SelectiveRuntime(mesh, Comm(mesh), "sdpa", PlannerConfig(), layers, heads, head_dim, cache_limit_bytes=cap)
    capped.allocate(local, 1, steps=50, branches=branches, device=device, local_tokens=local)
    held = capped.cache.nbytes() + capped.reference_bytes()
    rows.append(
        Row(
            "cache",
            f"a cap of half the units: composed k={capped.compose}, {capped.units} units (GB held)",
            held / 1e9,
            f"<= {cap / 1e9:.2f}",
            held <= cap and capped.compose > 1,
        )
    )
    capped.end_run()
    if dtype != torch.float32:
        fp32 = branches * layers * units * unit_bytes(1, local, heads, head_dim, torch.float32)
        rows.append(Row("cache", "the same cache in float32 would hold (GB; not allocated)", fp32 / 1e9, "-", True))
    return rows
