"""The memory model (planner/memory.py): its DiTango cache bytes are what the runtime allocates,
the component counts are those of the configs, sharding divides the weights, the pre-flight
refuses what will not fit and names a fix, and `ditango simulate` reports the peak."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from basics.errors import ConfigError
from planner.layout import ParallelLayout
from planner.memory import GIB, MemoryOptions, ditango_cache_bytes, estimate_memory, unit_bytes
from planner.models import VaeShape, VideoSize
from planner.preflight import fit_to_memory, preflight, usable_bytes
from runtime.models.registry import REGISTRY

WAN14 = REGISTRY["wan2.1-14b"].shape
P720 = VideoSize(720, 1280, 81)
ONE = ParallelLayout()


@pytest.mark.parametrize(
    ("dtype", "group", "own_group", "planner"),
    [
        (torch.float32, 1, "decide", "hpdc"),
        (torch.bfloat16, 1, "decide", "hpdc"),
        (torch.float32, 2, "decide", "hpdc"),  # the own group's partner is one more unit
        (torch.float32, 2, "fresh", "budget"),  # no partner unit; the previous step's reference
    ],
)
def test_ditango_cache_bytes_are_what_the_runtime_allocates(dtype, group, own_group, planner):
    """The pre-flight's cache is the runtime's: same formula, same buffers (cache + references)."""
    from planner.ditango import PlannerConfig
    from runtime import cache
    from runtime.comm import Comm
    from runtime.mesh import build_mesh
    from runtime.strategies.selective import SelectiveRuntime

    heads, head_dim, layers, tokens = 3, 8, 2, 41
    layout = ParallelLayout(1, 4 * group, strategy="ditango", group_size=group)  # 4 groups: 3 remote units
    mesh = build_mesh(ParallelLayout(strategy="ditango"), 0, (0,))
    cfg = PlannerConfig(own_group=own_group, planner=planner)
    rt = SelectiveRuntime(mesh, Comm(mesh), "torch", cfg, layers, heads, head_dim, cache_dtype=dtype)
    rt.groups, rt.group_size = (
        layout.groups,
        group,
    )  # the one-rank mesh sized as the layout (as test_ditango_runtime does)
    tokens = 41 if group == 1 else 81  # the largest chunk is 11 either way
    rt.allocate(11, 1, steps=6, branches=2)  # 41 tokens over 4 ranks: the largest chunk is 11
    shape = replace(WAN14, layers=layers, heads=heads, head_dim=head_dim)
    element = torch.empty((), dtype=dtype).element_size()
    assert rt.cache_peak_bytes == ditango_cache_bytes(shape, layout, tokens, 2, element, own_group, planner) > 0
    assert rt.units == 3 + (group > 1 and own_group == "decide")
    for B, S, H, D in ((1, 11, 3, 8), (2, 4096, 40, 128)):
        assert cache.unit_bytes(B, S, H, D, dtype) == unit_bytes(B, S, H, D, element)


def test_component_counts_and_vae_shapes_are_those_of_the_configs():
    """The registry's text encoder, VAE and block counts restate what the classes build."""
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLWan, HunyuanVideoTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from runtime.models import hunyuan, registry, wan
    from runtime.models.wan import models as wan_models

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        umt5 = UMT5Config(
            d_model=4096,
            d_ff=10240,
            num_layers=24,
            num_heads=64,
            d_kv=64,
            vocab_size=256384,
            feed_forward_proj="gated-gelu",
        )
        encoder = UMT5EncoderModel(umt5)
        block = count(encoder.encoder.block[0])
        text = wan_models.UMT5_XXL_PARAMS
        assert (count(encoder), block, count(encoder) - 24 * block, 0) == (
            text.params,
            text.block,
            text.root,
            text.whole,
        )
        vaes = {(m.name, family): m for family in (wan, hunyuan) for m in family.MODELS}
        for (key, family), model in vaes.items():
            config = model.vae
            vae = (AutoencoderKLHunyuanVideo if family is hunyuan else AutoencoderKLWan)(**config)
            assert count(vae) == model.vae_params, key
            shape = family.vae_shape_of(config, 0)
            # per decoder resolution: the widest residual convolution, and (Wan) the input
            # channels of the causal convolutions that keep frames between chunks
            convs = [[m for m in b.resnets.modules() if isinstance(m, torch.nn.Conv3d)] for b in vae.decoder.up_blocks]
            assert list(shape.widths) == [max(max(m.in_channels, m.out_channels) for m in c) for c in convs], key
            if family is wan:
                d = vae.decoder
                levels = [[d.conv_in, *d.mid_block.modules()], *[[*b.modules()] for b in d.up_blocks]]
                levels[0] += levels.pop(1)  # up block 0 runs at the latent's resolution
                levels[-1].append(d.conv_out)
                cached = [
                    sum(m.in_channels for m in ms if isinstance(m, torch.nn.Conv3d) and m.kernel_size[0] == 3)
                    for ms in levels
                ]
                assert list(shape.cached) == cached, key
        for key, family, config in [(m.name, f, m.transformer) for f in (wan, hunyuan) for m in f.MODELS if m.repo_id]:
            if family is hunyuan:
                model = HunyuanVideoTransformer3DModel(**{**config, "num_layers": 1, "num_single_layers": 1})
                assert count(model.transformer_blocks[0]) == hunyuan.block_params(config)
                single = count(model.single_transformer_blocks[0])
                assert hunyuan.blocks_params(config) == 20 * hunyuan.block_params(config) + 40 * single
            else:
                from diffusers import WanTransformer3DModel

                known = set(WanTransformer3DModel.extract_init_dict(config)[0])
                model = WanTransformer3DModel(
                    **{k: v for k, v in config.items() if k in known and k != "num_layers"}, num_layers=1
                )
                assert count(model.blocks[0]) == wan.block_params(config), key
    tiny = json.loads((registry.BUILTIN_DIR / "vae" / "config.json").read_text())
    assert all(tiny[k] == v for k, v in wan_models.TINY_VAE.items())
    tiny = json.loads((registry.BUILTIN_DIR / "transformer" / "config.json").read_text())
    assert all(tiny[k] == v for k, v in wan_models.TINY.items())
    assert REGISTRY["wan2.2-ti2v-5b"].shape.vae.spatial == 16 and REGISTRY["wan2.2-ti2v-5b"].shape.per_token_time
    assert REGISTRY["wan2.1-i2v-14b-720p"].shape.image_encoder_params > 6e8
    assert REGISTRY["wan2.2-i2v-a14b"].shape.image_encoder_params == 0  # its image goes into the latents


def test_shard_weights_divides_the_weights_by_the_ranks_that_run_the_same_blocks():
    eight = ParallelLayout(1, 8, strategy="ring")
    full = estimate_memory(WAN14, eight, P720).stages
    sharded = estimate_memory(WAN14, eight, P720, MemoryOptions(shard_weights=True)).stages
    assert full["weights"] == WAN14.params * 2 and full["weights_gathered"] == 0
    assert WAN14.block_params * WAN14.layers + WAN14.root_params == WAN14.params
    assert abs(sharded["weights"] * 8 - (WAN14.params - WAN14.root_params) * 2) <= 8 * 2
    # unsharded: the root (gathered at the first forward, left so), the block computing, the next one
    assert sharded["weights_gathered"] == (2 * WAN14.block_params + WAN14.root_params) * 2
    te = WAN14.text_encoder_params - WAN14.text_encoder_root_params  # UMT5's blocks shard, its embeddings gather
    assert abs(sharded["text_encoder"] * 8 - te * 2) <= 8 * 2 and sharded["text_encoder_gathered"] > 2e9
    cfg_split = ParallelLayout(1, 8, cfg_degree=2, strategy="ring")  # each CFG branch's cp group: 4 ranks
    split = estimate_memory(WAN14, cfg_split, P720, MemoryOptions(shard_weights=True)).stages
    assert abs(split["weights"] * 4 - (WAN14.params - WAN14.root_params) * 2) <= 4 * 2
    # sharded modules stay where FSDP put them: an offload moves nothing
    offload = MemoryOptions(shard_weights=True, offload_text_encoder=True, offload_transformer=True)
    assert (
        estimate_memory(WAN14, eight, P720, offload).phases
        == estimate_memory(WAN14, eight, P720, MemoryOptions(shard_weights=True)).phases
    )
    a14b = REGISTRY["wan2.2-t2v-a14b"].shape  # both experts resident
    assert estimate_memory(a14b, ONE, P720).stages["weights"] == 2 * full["weights"]


def test_one_gpu_14b_720p_needs_more_than_40_gib_and_its_phases_add_up():
    est = estimate_memory(WAN14, ONE, P720)
    # untiled, the decode's working set beside the resident transformer and encoders peaks
    assert est.peak_bytes > 40 * GIB and est.peak_stage == "decode"
    assert est.phases["denoise"] > est.phases["text_encode"] > est.stages["weights"]
    assert est.phases["decode"] == sum(est.stages[k] for k in ("weights", "text_encoder", "vae_weights", "vae_decode"))
    assert est.stages["nccl"] == 0  # one rank: no communicator
    tiled = estimate_memory(WAN14, ONE, P720, MemoryOptions(vae_tiling=True))
    assert tiled.peak_stage == "denoise" and tiled.peak_bytes == est.phases["denoise"] > 40 * GIB
    assert est.stages["attention_states"] == 0 and est.stages["ditango_cache"] == 0  # one rank: no ring, no cache
    ring = estimate_memory(WAN14, ParallelLayout(1, 8, strategy="ring"), P720)
    assert ring.stages["attention_states"] > 0 and ring.stages["activations"] < est.stages["activations"]
    assert json.loads(json.dumps(est.to_json()))["peak_stage"] == "decode"


def test_ditango_cache_counts_both_cfg_branches_on_one_rank_and_is_freed_before_decode():
    layout = ParallelLayout(2, 8, strategy="ditango", group_size=8)
    two = estimate_memory(WAN14, layout, P720, MemoryOptions(cfg_branches_per_rank=2))
    one = estimate_memory(WAN14, layout, P720, MemoryOptions(cfg_branches_per_rank=1))
    fp32 = estimate_memory(WAN14, layout, P720, MemoryOptions(cache_bytes=4))
    assert two.stages["ditango_cache"] == 2 * one.stages["ditango_cache"] > 0
    assert fp32.stages["ditango_cache"] > two.stages["ditango_cache"]
    assert "ditango_cache" not in two.resident["decode"] and two.phases["denoise"] > one.phases["denoise"]


def test_tiled_and_parallel_decode_hold_less_than_the_untiled_one():
    for name in ("wan2.1-14b", "hunyuanvideo"):
        shape = REGISTRY[name].shape
        untiled = estimate_memory(shape, ONE, P720).stages["vae_decode"]
        tiled = estimate_memory(shape, ONE, P720, MemoryOptions(vae_tiling=True)).stages["vae_decode"]
        parallel = estimate_memory(shape, ParallelLayout(1, 8, strategy="ring"), P720, MemoryOptions(vae_parallel=True))
        assert parallel.stages["vae_decode"] <= tiled < untiled, name
        # the writer holds the whole video at least (3 x 81 frames x 720 x 1280 float32)
        assert tiled > 3 * 81 * 720 * 1280 * 4


def test_preflight_refuses_24_gib_for_one_gpu_naming_the_fix_and_passes_141_gib():
    with pytest.raises(ConfigError) as info:
        preflight(WAN14, ONE, P720, MemoryOptions(), 24 * GIB, "wan2.1-14b 1280x720x81 on 1 GPU")
    message = str(info.value)
    assert (
        "\n" not in message
        and "24.0 GiB" in message
        and re.search(r"at its peak \((text_encode|denoise|decode)", message)
    )
    assert "--shard-weights" in message and "GPUs (--gpus-per-node" in message
    options = MemoryOptions()
    assert preflight(WAN14, ONE, P720, options, 141 * GIB, "x") == options


def test_the_named_fix_fits_and_offloads_are_turned_on_only_when_needed():
    with pytest.raises(ConfigError) as info:
        preflight(WAN14, ONE, P720, MemoryOptions(), 24 * GIB, "run")
    found = re.search(
        r"fits with --shard-weights( and --vae-parallel)? and (\d+) GPUs \(--gpus-per-node \2\)$", str(info.value)
    )
    assert found, str(info.value)
    gpus = int(found.group(2))
    layout = ParallelLayout(1, gpus, strategy="ring")
    named = MemoryOptions(shard_weights=True, vae_parallel=bool(found.group(1)))
    fitted = preflight(WAN14, layout, P720, named, 24 * GIB, "run")  # does not raise
    assert estimate_memory(WAN14, layout, P720, fitted).peak_bytes <= usable_bytes(24 * GIB)
    half = ParallelLayout(1, gpus // 2, strategy="ring")
    assert estimate_memory(WAN14, half, P720, named).peak_bytes > usable_bytes(24 * GIB)  # fewer ranks do not fit
    est = estimate_memory(WAN14, ONE, P720)
    roomy = fit_to_memory(WAN14, ONE, P720, MemoryOptions(), est.peak_bytes * 2)
    assert roomy == MemoryOptions()
    # just short of the peak: offloading the encoders after encoding is enough
    tight = int((est.peak_bytes + 2 * GIB) / 0.95) - 2 * GIB
    short = fit_to_memory(WAN14, ONE, P720, MemoryOptions(), tight)
    assert short.offload_text_encoder and not short.offload_transformer


def test_a_gpu_too_small_for_the_encoders_is_told_so():
    shape = REGISTRY["wan2.1-1.3b"].shape  # UMT5's token embeddings (2.0 GiB) are gathered on every rank
    with pytest.raises(
        ConfigError, match="no option makes it fit: the encoders' embeddings and the VAE alone need 2.4"
    ):
        preflight(shape, ONE, VideoSize(480, 832, 81), MemoryOptions(), 2 * GIB, "wan2.1-1.3b")


def test_options_and_shapes_are_validated():
    with pytest.raises(ConfigError, match="dtype_bytes must be 2"):
        MemoryOptions(dtype_bytes=3)
    with pytest.raises(ConfigError, match="cfg_branches_per_rank"):
        MemoryOptions(cfg_branches_per_rank=3)
    with pytest.raises(ConfigError, match="spatial ratio"):
        VaeShape(spatial=16)


def test_simulate_reports_peak_memory_per_strategy(runner):
    from ditango_cli.app import app

    base = ["simulate", "--model", "wan2.1-14b", "--nodes", "1", "--height", "720", "--width", "1280", "--frames", "81"]
    one = runner.invoke(app, [*base, "--gpus-per-node", "1", "--json"])
    assert one.exit_code == 0, one.stderr
    rows = json.loads(one.stdout)["rows"]
    assert rows and all(r["peak_memory_bytes"] > 40 * GIB and r["peak_memory_stage"] == "decode" for r in rows)
    assert all(r["fits"] is True for r in rows)  # the h20 profile's 96 GB
    eight = runner.invoke(app, [*base, "--gpus-per-node", "8", "--shard-weights", "--json"])
    sharded = {r["strategy"]: r for r in json.loads(eight.stdout)["rows"]}
    assert 7.9 < rows[0]["weights_bytes"] / sharded["ring"]["weights_bytes"] < 8.3  # the shard of the blocks
    small = runner.invoke(app, [*base, "--gpus-per-node", "1", "--gpu-memory", "24GiB", "--json"])
    assert all(r["fits"] is False for r in json.loads(small.stdout)["rows"])
    # 48 GB: fits once the runtime offloads; the encoders beside the transformer then peak
    table = runner.invoke(app, [*base, "--gpus-per-node", "1", "--hardware", "l40s"], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and "text_encode" in table.stdout and "yes" in table.stdout


def test_check_runs_the_preflight_before_any_weights_are_needed(runner, tmp_path):
    """`check --gpu-memory` on a named model refuses a run that cannot fit, naming the fix,
    without the checkpoint (planning from a laptop); what fits goes on to the directory check."""
    from ditango_cli.app import app

    base = [
        "check",
        "--model",
        "wan2.1-14b",
        "--prompt",
        "a cat",
        "--height",
        "720",
        "--width",
        "1280",
        "--frames",
        "81",
        "--out",
        str(tmp_path / "out"),
    ]
    refused = runner.invoke(app, [*base, "--gpu-memory", "24GiB"])
    assert refused.exit_code == 2
    line = refused.stderr.strip()
    assert "\n" not in line and "GiB per GPU at its peak" in line and "--shard-weights" in line, line
    fits = runner.invoke(app, [*base, "--gpu-memory", "24GiB", "--gpus", "8", "--shard-weights"])
    assert fits.exit_code == 2 and "ditango download wan2.1-14b" in fits.stderr  # past the pre-flight
    small = runner.invoke(app, [*base, "--gpu-memory", "1GiB"])
    assert small.exit_code == 2 and "below 2 GiB" in small.stderr


def test_check_reports_the_offloads_a_short_gpu_needs(runner, tmp_path):
    from ditango_cli.app import app

    base = ["check", "--prompt", "a cat", "--out", str(tmp_path / "out"), "--json"]
    roomy = runner.invoke(app, [*base, "--gpu-memory", "80GiB"])
    assert roomy.exit_code == 0, roomy.stderr
    summary = json.loads(roomy.stdout)
    assert summary["gpu_memory"] == 80 * GIB and summary["offload"] == []
    assert json.loads(runner.invoke(app, base).stdout)["gpu_memory"] is None  # CPU, not asked: no pre-flight


def test_plan_memory_turns_the_fitted_offloads_into_the_runs():
    from runtime.config import Item, RunConfig
    from runtime.memory_plan import plan_memory

    item = Item("a", "a cat", "", 0, 720, 1280, 81, 50, 5.0)
    cfg = RunConfig("wan2.1-14b", None, (item,), Path("/nonexistent"))
    assert plan_memory(cfg, WAN14, 141 * GIB, 2, "wan2.1-14b").offload == ()
    short = plan_memory(cfg, WAN14, 48 * GIB, 2, "wan2.1-14b")  # the untiled decode beside 26.6 GiB of weights
    assert "transformer" in short.offload and short.gpu_memory == 48 * GIB


def test_each_distinct_communicator_is_budgeted():
    from planner.memory import NCCL_COMM_BYTES, communicators

    # ring without CFG: cp, ring and world are one set; near/ulysses/cfg groups have one member
    assert communicators(ParallelLayout(4, 8, strategy="ring")) == 1
    # usp 4x8 (ulysses 8): the node's Ulysses group, the ring across nodes, the world
    assert communicators(ParallelLayout(4, 8, strategy="usp").with_defaults(40)) == 3
    # ditango, group = node: the near group (the node) and the world
    assert communicators(ParallelLayout(4, 8, strategy="ditango", group_size=8)) == 2
    # cfg-parallel: each branch's cp group, the CFG pair and the world
    assert communicators(ParallelLayout(1, 8, cfg_degree=2, strategy="ring")) == 3
    usp = estimate_memory(WAN14, ParallelLayout(4, 8, strategy="usp").with_defaults(40), P720)
    assert usp.stages["nccl"] == 3 * NCCL_COMM_BYTES and all(usp.resident[p]["nccl"] for p in usp.resident)
