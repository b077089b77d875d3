"""Tensor parallelism (--parallel tp): one transformer forward and the whole denoising loop
against one process, tp over 4 gloo ranks on two virtual nodes and over 2 (each branch of
cfg-parallel), an image-to-video model (added_kv_proj_dim), the counted bytes against the
traffic model and the ring formula, the layout checks, and the cost and memory models' tp."""

from __future__ import annotations

import pytest
import torch

from basics.errors import ConfigError
from planner.comparison import compare_layouts
from planner.cost_model import HARDWARE, estimate
from planner.layout import ParallelLayout, replica_layout, virtual_node_map
from planner.memory import estimate_memory
from planner.models import ModelShape, VideoSize
from planner.traffic import predict_traffic
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.item_records import sum_comm
from runtime.mesh import build_mesh
from runtime.models import hunyuan
from runtime.models.loading import resolve_placement
from runtime.strategies import parallelize
from slurm.launchers.processes import run_ranks
from tests.test_cp_pipeline import CP_MODEL, GEN, SIZE, TEXT_LEN, denoise
from tiny_wan import build_tiny_wan

TP_ATOL = 1e-4  # the exact strategies' bound in float32: the all-reduces change rounding, nothing else may
TIMEOUT_S = 90
# CP_MODEL: 12 heads and FFN 48, so tp 2, 3 and 4 are legal; 30 tokens at SIZE.
SHAPE = ModelShape(
    "tp-test",
    layers=CP_MODEL.layers,
    heads=CP_MODEL.heads,
    head_dim=CP_MODEL.head_dim,
    ffn=CP_MODEL.ffn_dim,
    text_len=TEXT_LEN,
    text_dim=CP_MODEL.text_dim,
)
TOKENS = 30
# Wan2.1 I2V's cross-attention: image keys through add_k_proj/add_v_proj (from the C-wide image
# embedding, so added_kv_proj_dim = C) and norm_added_k.
# diffusers' processor takes all but the last 512 text tokens for the image, so the text is 512 long.
I2V = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=8,
    in_channels=36,
    out_channels=16,
    text_dim=24,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    image_dim=20,
    added_kv_proj_dim=32,
    rope_max_seq_len=32,
)
I2V_TEXT, I2V_IMAGE = 512, 5
# One launch of 4 ranks on 2 virtual nodes (node map 0, 0, 1, 1; each launch costs its ranks'
# imports): (name, cfg degree, tp degree). tp over all 4 ranks, and cfg-parallel with tp over
# the 2 ranks of each branch.
WORLD, NODES = 4, 2
RUNS = [("tp", 1, 4), ("cfg_tp", 2, 2)]


def forward_inputs(in_channels: int, text_dim: int, text: int, image_dim: int | None = None) -> dict:
    g = torch.Generator().manual_seed(17)
    kwargs = dict(
        hidden_states=torch.randn(1, in_channels, 2, 6, 10, generator=g),
        timestep=torch.tensor([700.0]),
        encoder_hidden_states=torch.randn(1, text, text_dim, generator=g),
        return_dict=False,
    )
    if image_dim is not None:
        kwargs["encoder_hidden_states_image"] = torch.randn(1, I2V_IMAGE, image_dim, generator=g)
    return kwargs


def _collective_counts(debug) -> dict:
    return {str(op): n for op, n in debug.get_comm_counts().items() if n}


def _target(rank, world, events):
    from diffusers import WanTransformer3DModel
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    components = build_tiny_wan(CP_MODEL)
    model = components["transformer"]
    x = forward_inputs(CP_MODEL.z_dim, CP_MODEL.text_dim, TEXT_LEN)
    with torch.no_grad():
        reference = model(**x)[0]  # one process's forward, on every rank
    meshes = {}
    for name, cfg_degree, _ in RUNS:
        layout = ParallelLayout(nodes=NODES, gpus_per_node=world // NODES, cfg_degree=cfg_degree, strategy="tp")
        mesh = meshes[name] = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(mesh)
        den = build_denoiser(components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm)
        with torch.no_grad(), CommDebugMode() as debug:
            forward = model(**x)[0]
        forward_bytes = comm.totals()
        comm.reset()
        latents = denoise(den)
        den.parallel.remove()
        with torch.no_grad():
            restored = model(**x)[0]
        out[name] = dict(
            forward_err=(forward - reference).abs().max().item(),
            collectives=_collective_counts(debug),
            forward_bytes=forward_bytes,
            latents=latents,
            bytes=comm.totals(),
            restored=torch.equal(restored, reference),
        )

    torch.manual_seed(5)
    i2v = WanTransformer3DModel(**I2V).eval()
    x = forward_inputs(I2V["in_channels"], I2V["text_dim"], I2V_TEXT, I2V["image_dim"])
    comm = Comm(meshes["tp"])
    with torch.no_grad():
        reference = i2v(**x)[0]
        handle = parallelize(i2v, meshes["tp"], comm, "sdpa")
        forward = i2v(**x)[0]
    out["i2v"] = dict(forward_err=(forward - reference).abs().max().item(), forward_bytes=comm.totals())
    handle.remove()
    return out


@pytest.fixture(scope="module")
def reference():
    return denoise(Denoiser(build_tiny_wan(CP_MODEL), resolve_placement("cpu"), TEXT_LEN))


def ring_received(nbytes: int, n: int) -> int:
    """Each rank's share of a ring all-reduce, written out: 2 (n - 1) chunks of nbytes / n."""
    return 2 * (n - 1) * nbytes // n


@pytest.mark.distributed
def test_tp_equals_one_process_and_counts_ring_bytes(reference):
    """Latents and one forward within TP_ATOL of one process at tp 4 and 2, identical on every
    rank; remove() restores the model bit for bit; the bytes counted equal the traffic model's,
    link by link, and the ring formula."""
    world, nodes = WORLD, NODES
    per_rank = run_ranks(_target, world, timeout_s=TIMEOUT_S)
    C = CP_MODEL.heads * CP_MODEL.head_dim
    for name, cfg_degree, n in RUNS:
        layout = ParallelLayout(nodes=nodes, gpus_per_node=world // nodes, cfg_degree=cfg_degree, strategy="tp")
        assert layout.tp == n
        # Per rank and forward: three [S, C] and four [S or L, 1] float32 all-reduces a block, as a ring.
        per_block = 3 * ring_received(TOKENS * C * 4, n) + sum(
            ring_received(4 * m, n) for m in (TOKENS, TOKENS, TOKENS, TEXT_LEN)
        )
        for rank in range(world):
            got = per_rank[rank][name]
            err = (got["latents"] - reference).abs().max().item()
            assert got["forward_err"] <= TP_ATOL and err <= TP_ATOL, (name, rank, got["forward_err"], err)
            assert torch.equal(got["latents"], per_rank[0][name]["latents"]), (name, rank)
            assert got["restored"], (name, rank)
            # DTensor runs one all-reduce per row-wise layer (3 a block) and the norms 4 more; nothing
            # else moves, so the hooks that count the row-wise ones count all there is.
            assert got["collectives"] == {
                "c10d_functional.all_reduce": 3 * CP_MODEL.layers,
                "c10d.allreduce_": 4 * CP_MODEL.layers,
            }, got["collectives"]
            fwd = got["forward_bytes"]
            assert fwd["intra_node_bytes"] + fwd["inter_node_bytes"] == CP_MODEL.layers * per_block
        measured = sum_comm([per_rank[r][name]["bytes"] for r in range(world)])
        predicted = predict_traffic(
            layout, SHAPE, VideoSize(**SIZE), GEN["steps"], element_bytes=4, node_of=virtual_node_map(layout)
        )
        assert predicted == measured, name
        forwards = GEN["steps"] * 2 // cfg_degree  # per rank: both CFG branches, or its own
        assert sum(measured["by_purpose"]["tp"].values()) == world * forwards * CP_MODEL.layers * per_block
        links = measured["by_purpose"]["tp"]
        if name == "tp":  # ring 0 -> 1 -> 2 -> 3 -> 0 over nodes {0, 1} | {2, 3}: two hops cross
            assert links["inter_node_bytes"] == links["intra_node_bytes"] > 0
        else:  # each CFG branch's pair inside its node (the CFG exchange crosses)
            assert set(links) == {"intra_node_bytes"} and measured["by_purpose"]["cfg"]["inter_node_bytes"] > 0
    i2v_shape = ModelShape(
        "i2v-test",
        layers=I2V["num_layers"],
        heads=I2V["num_attention_heads"],
        head_dim=I2V["attention_head_dim"],
        ffn=I2V["ffn_dim"],
        text_len=I2V_TEXT,
        image_tokens=I2V_IMAGE,
    )
    layout = ParallelLayout(nodes, world // nodes, strategy="tp")
    predicted = predict_traffic(layout, i2v_shape, VideoSize(48, 80, 5), 1, guidance=False, element_bytes=4)
    assert predicted == sum_comm([per_rank[r]["i2v"]["forward_bytes"] for r in range(world)])
    for rank in range(world):
        assert per_rank[rank]["i2v"]["forward_err"] <= TP_ATOL, (rank, per_rank[rank]["i2v"])


def test_tp_layout_and_model_checks():
    layout = ParallelLayout(nodes=2, gpus_per_node=2, strategy="tp")
    assert (layout.tp, layout.ring, layout.ulysses, layout.cp_degree) == (4, 1, 1, 4)
    assert ParallelLayout(nodes=1, gpus_per_node=4, cfg_degree=2, strategy="tp").tp == 2
    layout.check_model(12, ffn=48)  # legal: nothing raised
    cases = [
        ((10,), {}, "tp degree 4 must divide the model's 10 attention heads; use --parallel ring, or tp over 2"),
        ((12,), {"ffn": 42}, "tp degree 4 must divide the model's 42 FFN width; use --parallel ring, or tp over 2"),
        ((7,), {}, "tp degree 4 must divide the model's 7 attention heads; use --parallel ring"),
        ((24,), {"joint_text": True}, "--parallel tp is not supported yet for joint text-video models (HunyuanVideo)"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ConfigError) as info:
            layout.check_model(*args, **kwargs)
        assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="tp degree 4 must divide the model's 42 FFN width"):
        replica_layout(1, 4, 1, 12, strategy="tp", ffn=42)
    with pytest.raises(ConfigError, match="--ulysses-degree only applies to --parallel usp"):
        replica_layout(1, 4, 1, 12, strategy="tp", ulysses_degree=2)
    with pytest.raises(ConfigError, match="--group-size only applies to --parallel ditango"):
        replica_layout(1, 4, 1, 12, strategy="tp", group_size=2)
    with pytest.raises(ConfigError, match="^--parallel tp is not supported yet for HunyuanVideo"):
        hunyuan.install_tp(None, None)


def test_cost_model_prices_and_lists_tp():
    from runtime.models.registry import REGISTRY

    shape = REGISTRY["wan2.1-14b"].shape  # 40 heads, FFN 13824: tp 4 and 8, not 12
    hw = HARDWARE["h100"]
    rows, notes = compare_layouts(hw, shape, 2, 4, ["ring", "ulysses", "tp"], "node", VideoSize(480, 832, 81), 50)
    tp = {r["nodes"]: r for r in rows if r["strategy"] == "tp"}
    assert set(tp) == {1, 2} and {r["nodes"] for r in rows if r["strategy"] == "ring"} == {1, 2}
    assert tp[1]["inter_node_bytes"] == 0 < tp[2]["inter_node_bytes"]
    for r in tp.values():
        layout = ParallelLayout(r["nodes"], 4, strategy="tp")
        bytes_ = predict_traffic(layout, shape, VideoSize(480, 832, 81), 50)
        assert (r["inter_node_bytes"], r["intra_node_bytes"]) == (
            bytes_["inter_node_bytes"],
            bytes_["intra_node_bytes"],
        )
        assert r["speedup_vs_best_exact"] is not None  # an exact strategy
    ring = next(r for r in rows if r["strategy"] == "ring" and r["nodes"] == 1)
    assert tp[1]["weights_bytes"] < ring["weights_bytes"] / 2  # the blocks' weights split four ways

    # Attention: the local heads over all tokens, 1/n of one process's; the same degree across
    # a node boundary is slower (its all-reduces cross the NIC), and a heads count that tp
    # cannot split is a note, not a row.
    one = estimate(hw, ParallelLayout(1, 1), shape, VideoSize(480, 832, 81), 50)
    inside = estimate(hw, ParallelLayout(1, 4, strategy="tp"), shape, VideoSize(480, 832, 81), 50)
    across = estimate(hw, ParallelLayout(2, 2, strategy="tp"), shape, VideoSize(480, 832, 81), 50)
    assert inside.attention_s == pytest.approx(one.attention_s / 4, rel=1e-9)
    assert one.step_s / 4 < inside.step_s < across.step_s
    _, notes = compare_layouts(hw, shape, 3, 4, ["tp"], "node", VideoSize(480, 832, 81), 50)
    assert notes == [
        "tp on 3 node(s): tp degree 12 must divide the model's 40 attention heads; use --parallel ring, "
        "or tp over 4 ranks per cp group"
    ]
    # Memory: 1/n of each block's split weights; the root (embeddings, head) and 11 C a block whole.
    whole = estimate_memory(shape, ParallelLayout(1, 1), VideoSize(480, 832, 81)).stages["weights"]
    assert whole == 2 * shape.params
    split = estimate_memory(shape, ParallelLayout(1, 4, strategy="tp"), VideoSize(480, 832, 81)).stages["weights"]
    kept = shape.root_params + shape.layers * 11 * shape.hidden
    assert split == pytest.approx(2 * (kept + (shape.params - kept) / 4), rel=1e-6)


def test_a_tp_shard_owns_only_its_bytes():
    """A shard made without a message (src_data_rank=None) can be a view of the whole weight, which
    then stays alive: the split would save no memory. One process as rank 0 of 2 (fake group)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.strategies.tensor import own_storage

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = DeviceMesh("cpu", [0, 1])
        whole = torch.randn(8, 6)
        linear = nn.Linear(6, 8, bias=False)
        view = DTensor.from_local(whole[:4], mesh, [Shard(0)], run_check=False, shape=(8, 6), stride=(6, 1))
        linear.weight = nn.Parameter(view, requires_grad=False)
        assert view.to_local().untyped_storage().nbytes() == whole.numel() * 4  # the whole weight, kept alive
        own_storage(linear)
        local = linear.weight.to_local()
        assert local.untyped_storage().nbytes() == 4 * 6 * 4 and torch.equal(local, whole[:4])
        assert linear.weight.shape == (8, 6) and linear.weight.placements == (Shard(0),)
    finally:
        dist.destroy_process_group()
