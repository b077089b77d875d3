"""--quantize fp8 and --compile in the planner (planner/precision.py): the bytes fp8 weights take,
counted independently on diffusers' own modules; what they cost and save in the cost model;
and the refusals of fp8 where the GPU has no FP8 matmuls."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ditango_cli.app import app
from planner.cost_model import HARDWARE, Hardware, estimate, load_hardware, rest_of_block_time
from planner.layout import ParallelLayout
from planner.memory import GIB, MemoryOptions, estimate_memory
from planner.models import ModelShape, VideoSize
from planner.precision import attention_pricing, block_bytes, check_fp8_device, transformer_bytes
from runtime.models.registry import REGISTRY
from tests.conftest import refused

P720, P480 = VideoSize(720, 1280, 81), VideoSize(480, 832, 81)


def fp8_count(model: torch.nn.Module, blocks: list[str], e: int) -> tuple[int, int]:
    """(all parameter bytes under fp8, the largest block's), counted on the module itself: every
    nn.Linear inside `blocks` whose sides are multiples of 16 at one byte a weight and four a
    row; everything else (biases included) at `e`."""
    quantized = {
        id(m.weight): m.out_features
        for name in blocks
        for m in model.get_submodule(name).modules()
        if isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
    }

    def count(params) -> int:
        return sum(p.numel() + 4 * quantized[id(p)] if id(p) in quantized else p.numel() * e for p in params)

    largest = max(blocks, key=lambda name: sum(p.numel() for p in model.get_submodule(name).parameters()))
    return count(model.parameters()), count(model.get_submodule(largest).parameters())


def shape_of_module(model, blocks: list[str], **shape) -> ModelShape:
    """The shape the registry would make of `model`: its sizes from the caller, its parameter
    counts (total, largest block, root) from the module."""
    sizes = [sum(p.numel() for p in model.get_submodule(name).parameters()) for name in blocks]
    params = sum(p.numel() for p in model.parameters())
    return ModelShape(params=params, block_params=max(sizes), root_params=params - sum(sizes), **shape)


@pytest.mark.parametrize("ffn, image", [(64, False), (40, False), (64, True)])
def test_fp8_bytes_match_the_linears_of_a_real_wan_transformer(ffn, image):
    """A tiny WanTransformer3DModel (an FFN of 40, not a multiple of 16: left in bf16; I2V's
    added k/v projections) against the planner's count from its shape alone."""
    from diffusers import WanTransformer3DModel

    extra = {"added_kv_proj_dim": 32, "image_dim": 24} if image else {}
    model = WanTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=3,
        ffn_dim=ffn,
        text_dim=24,
        freq_dim=16,
        in_channels=4,
        out_channels=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        **extra,
    )
    blocks = [f"blocks.{i}" for i in range(3)]
    shape = shape_of_module(
        model, blocks, name="tiny", layers=3, heads=2, head_dim=16, ffn=ffn, text_len=8, image_tokens=257 * image
    )
    whole, block = fp8_count(model, blocks, 2)
    assert transformer_bytes(shape, 2, "fp8") == whole
    assert block_bytes(shape, 2, "fp8") == block
    assert transformer_bytes(shape, 2, "none") == shape.params * 2


def test_fp8_bytes_match_the_linears_of_a_real_hunyuan_transformer():
    """Dual- and single-stream blocks, their modulation linears among the block's layers; how
    many of each the planner solves from the shape's parameter counts."""
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=3,
        num_refiner_layers=1,
        in_channels=4,
        out_channels=4,
        text_embed_dim=32,
        pooled_projection_dim=16,
        mlp_ratio=3.0,
        rope_axes_dim=(4, 6, 6),
    )
    blocks = [f"transformer_blocks.{i}" for i in range(2)] + [f"single_transformer_blocks.{i}" for i in range(3)]
    shape = shape_of_module(model, blocks, name="tiny", layers=5, heads=2, head_dim=16, ffn=96, text_len=8)
    shape = replace(shape, joint_text=True)
    whole, block = fp8_count(model, blocks, 4)
    assert transformer_bytes(shape, 4, "fp8") == whole
    assert block_bytes(shape, 4, "fp8") == block


def test_wan14b_fp8_is_about_half_of_bf16_counted_on_its_meta_build():
    """The registry's wan2.1-14b under fp8, against its diffusers build on the meta device; about
    half the bf16 bytes (the quantized weights go from 2 bytes to 1, plus 4 bytes a row)."""
    from diffusers import WanTransformer3DModel

    config = REGISTRY["wan2.1-14b"].named.transformer
    known = set(WanTransformer3DModel.extract_init_dict(config)[0])
    with torch.device("meta"):
        model = WanTransformer3DModel(**{k: v for k, v in config.items() if k in known})
    shape = REGISTRY["wan2.1-14b"].shape
    whole, _ = fp8_count(model, [f"blocks.{i}" for i in range(shape.layers)], 2)
    assert transformer_bytes(shape, 2, "fp8") == whole
    assert 0.5 < whole / (shape.params * 2) < 0.52


def test_memory_model_counts_fp8_weights_whole_and_sharded():
    """The pre-flight's weights (and what the rehearsal's load phase models) fall by what fp8
    saves; sharded, the blocks FSDP gathers are fp8 blocks."""
    shape = REGISTRY["wan2.1-14b"].shape
    usp = ParallelLayout(1, 2, strategy="usp")
    bf16, fp8 = (estimate_memory(shape, usp, P480, MemoryOptions(quantize=q)) for q in ("none", "fp8"))
    assert bf16.stages["weights"] == shape.params * 2
    assert bf16.phases["load"] - fp8.phases["load"] == shape.params * 2 - transformer_bytes(shape, 2, "fp8")
    assert bf16.phases["load"] - fp8.phases["load"] > 12 * GIB  # the rehearsal's acceptance margin
    eight = ParallelLayout(1, 8, strategy="ring")
    sharded = estimate_memory(shape, eight, P720, MemoryOptions(shard_weights=True, quantize="fp8")).stages
    assert sharded["weights_gathered"] == shape.root_params * 2 + 2 * block_bytes(shape, 2, "fp8")
    assert block_bytes(shape, 2, "fp8") < shape.block_params * 2 * 0.51
    with pytest.raises(ValueError, match="--quantize 'int4'"):
        MemoryOptions(quantize="int4")


def test_a_runs_memory_options_carry_its_quantization():
    """runtime/memory_plan.py feeds the pre-flight, --mem and the rehearsal's modelled side."""
    from runtime.config import DecodeOptions
    from runtime.memory_plan import item_memory_options

    item = SimpleNamespace(height=480, width=832, frames=81, cfg_scale=5.0)
    cfg = SimpleNamespace(
        ditango=None,
        items=[item],
        shard_weights=False,
        hybrid=None,
        layout=ParallelLayout(1, 2, strategy="usp"),
        decode=DecodeOptions(),
        quantize="fp8",
    )
    ((_, options),) = item_memory_options(cfg, 2)
    assert options.quantize == "fp8"


def test_host_memory_counts_an_offloaded_fp8_transformer_at_its_bytes():
    from planner.host_memory import host_memory

    shape = REGISTRY["wan2.1-14b"].shape
    one = ParallelLayout(1, 1)
    parts = {
        q: host_memory(shape, one, MemoryOptions(quantize=q, offload_transformer=True), 1, on_gpu=True).parts
        for q in ("none", "fp8")
    }
    assert parts["none"]["run"] - parts["fp8"]["run"] == shape.params * 2 - transformer_bytes(shape, 2, "fp8")
    # fp8 loads the transformer on the host, whole in bfloat16, to quantize it layer by layer onto the GPU
    assert parts["none"]["load"] == 0 and parts["fp8"]["load"] == shape.params * 2


# -- time ------------------------------------------------------------------------------------


def test_fp8_prices_matmuls_at_the_fp8_peak_and_pays_the_quantization_pass():
    """Short sequences (matmul-bound): fp8 below bf16 on H100; on a profile whose fp8 peak is
    its bf16 one, fp8 is slower (the quantization pass is all it adds)."""
    shape = REGISTRY["wan2.1-14b"].shape
    hw = HARDWARE["h100"]
    bf16, fp8 = (rest_of_block_time(hw, shape, 4096, 2, q) for q in ("none", "fp8"))
    assert fp8 < bf16
    same = replace(hw, fp8_tflops=hw.bf16_tflops)
    assert rest_of_block_time(same, shape, 4096, 2, "fp8") > rest_of_block_time(same, shape, 4096, 2, "none")
    layout = ParallelLayout(1, 8, strategy="usp")
    e2e = {q: estimate(hw, layout, shape, VideoSize(480, 832, 17), 50, quantize=q).e2e_s for q in ("none", "fp8")}
    assert e2e["fp8"] < e2e["none"]


def test_compile_scales_the_elementwise_work_by_the_profile_factor():
    shape = REGISTRY["wan2.1-14b"].shape
    hw = HARDWARE["h100"]
    assert hw.compile_factor < 1
    eager, compiled = (rest_of_block_time(hw, shape, 9450, 2, "none", c) for c in (False, True))
    assert compiled < eager
    flat = replace(hw, compile_factor=1.0)
    assert rest_of_block_time(flat, shape, 9450, 2, "none", True) == rest_of_block_time(flat, shape, 9450, 2)


def test_profiles_fp8_peaks_and_a_profile_file_without_the_new_fields(tmp_path):
    assert HARDWARE["a100"].fp8_tflops is None
    for name in ("h20", "h100", "h200", "l40s"):  # dense: twice the dense bf16 peak on these parts
        assert HARDWARE[name].fp8_tflops == pytest.approx(2 * HARDWARE[name].bf16_tflops, rel=0.02)
    old = {"name": "x", "bf16_tflops": 500.0, "hbm_tbps": 2.0, "intra_gbps": 300.0, "inter_gbps": 25.0, "latency_us": 5}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    hw = load_hardware(str(path))
    assert (hw.fp8_tflops, hw.compile_factor) == (None, 1.0)
    path.write_text(json.dumps({**old, "fp8_tflops": 900.0, "compile_factor": 0.6}))
    assert (load_hardware(str(path)).fp8_tflops, load_hardware(str(path)).compile_factor) == (900.0, 0.6)
    for bad in ({"compile_factor": 1.5}, {"compile_factor": 0}, {"fp8_tflops": -1}, {"fp8_tflops": "fast"}):
        path.write_text(json.dumps({**old, **bad}))
        with pytest.raises(ValueError, match=next(iter(bad))):
            load_hardware(str(path))


# -- refusals and simulate -------------------------------------------------------------------


def test_fp8_is_refused_below_compute_capability_8_9():
    check_fp8_device((8, 9))
    check_fp8_device((9, 0))
    for old in ((8, 0), (8, 6), (7, 0)):
        with pytest.raises(ValueError, match=f"compute capability {old[0]}.{old[1]}"):
            check_fp8_device(old)


def test_a_local_run_asks_its_gpu_and_a_submission_does_not(monkeypatch):
    from ditango_cli.run_config import fp8_device_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda")
    assert "A100" in fp8_device_problem("fp8", cuda, "local")
    assert fp8_device_problem("none", cuda, "local") is None
    assert fp8_device_problem("fp8", cuda, "sbatch") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_device_problem("fp8", cuda, "local") is None


def test_fp8_on_a_profile_without_an_fp8_peak_is_refused(runner, tmp_path):
    refused(runner.invoke(app, ["simulate", "--hardware", "a100", "--quantize", "fp8"]), "a100", "fp8_tflops")
    old = {
        "name": "mine",
        "bf16_tflops": 500.0,
        "hbm_tbps": 2.0,
        "intra_gbps": 300.0,
        "inter_gbps": 25.0,
        "latency_us": 5,
    }
    (tmp_path / "hw.json").write_text(json.dumps(old))
    result = runner.invoke(app, ["simulate", "--hardware-file", str(tmp_path / "hw.json"), "--quantize", "fp8"])
    refused(result, "mine")
    ranking = ["simulate", "--hardware", "a100", "--quantize", "fp8", "--batch", "4"]
    refused(runner.invoke(app, ranking), "a100")
    check = [
        "check",
        "--prompt",
        "a red circle",
        "--steps",
        "3",
        "--height",
        "32",
        "--width",
        "64",
        "--frames",
        "5",
        "--device",
        "cpu",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--executor",
        "local",
        "--layout",
        "auto",
        "--hardware",
        "a100",
        "--quantize",
        "fp8",
        "--out",
        str(tmp_path / "o"),
    ]
    refused(runner.invoke(app, check), "a100")
    assert not (tmp_path / "o").exists()
    check[check.index("a100")] = "h100"
    assert runner.invoke(app, check).exit_code == 0


def test_simulate_prints_the_precision_section_beside_the_published_time(runner):
    args = [
        "simulate",
        "--model",
        "wan2.1-14b",
        "--hardware",
        "h100",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--height",
        "720",
        "--width",
        "1280",
        "--frames",
        "81",
        "--steps",
        "50",
        "--parallel",
        "ring,usp",
    ]
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    precision = data["precision"]
    e2e = precision["e2e_s"]
    flash3 = {"none_compiled_flash3", "fp8_compiled_flash3"}  # h100 prices FlashAttention-3
    assert set(e2e) == {"none", "none_compiled", "fp8", "fp8_compiled", *flash3}
    assert e2e["fp8_compiled"] < e2e["fp8"] < e2e["none"] and e2e["none_compiled"] < e2e["none"]
    assert e2e["fp8_compiled_flash3"] < e2e["none_compiled_flash3"] < e2e["none_compiled"]
    assert e2e["fp8_compiled_flash3"] < e2e["fp8_compiled"]
    assert precision["published_s"] == 287.9
    assert data["assumptions"]["attention"] == "flash3"  # simulate's default auto: flash3 on h100
    best = min(data["rows"], key=lambda r: r["e2e_s"])
    assert best["e2e_s"] == pytest.approx(e2e["none_compiled_flash3"])  # the default: compiled, bf16, auto
    flash = json.loads(runner.invoke(app, [*args, "--json", "--attention", "flash"]).stdout)
    assert flash["assumptions"]["attention"] == "flash" and flash["precision"] == precision
    assert min(r["e2e_s"] for r in flash["rows"]) == pytest.approx(e2e["none_compiled"])
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.stderr
    assert "fp8 + compile (s)" in table.stdout and "287.9" in table.stdout
    assert "fp8 + compile + FA3 (s)" in table.stdout and "bf16 + compile + FA3 (s)" in table.stdout
    assert f"{e2e['fp8_compiled']:.1f}" in table.stdout and f"{e2e['fp8_compiled_flash3']:.1f}" in table.stdout
    quantized = json.loads(runner.invoke(app, [*args, "--json", "--quantize", "fp8"]).stdout)
    assert min(r["e2e_s"] for r in quantized["rows"]) == pytest.approx(e2e["fp8_compiled_flash3"])
    a100 = json.loads(runner.invoke(app, [*args[:4], "a100", *args[5:], "--json"]).stdout)["precision"]
    assert set(a100["e2e_s"]) == {"none", "none_compiled"} and "published_s" not in a100
    l40s = json.loads(runner.invoke(app, [*args[:4], "l40s", *args[5:], "--json", "--attention", "flash3"]).stdout)
    assert l40s["assumptions"]["attention"] == "flash3" and not set(l40s["precision"]["e2e_s"]) & flash3


# -- --attention: FlashAttention-3 --------------------------------------------------------------


def test_flash3_prices_attention_at_its_efficiency_where_the_profile_has_one():
    """h100: attention under flash3 takes attention_efficiency / flash3_efficiency of flash's time
    (one GPU: nothing but the kernel; a ring: its hops compute-bound at 720p, about the same),
    the cross-attention too; bytes unchanged. l40s has no flash3_efficiency: flash3 falls back."""
    shape, h100 = REGISTRY["wan2.1-14b"].shape, HARDWARE["h100"]
    assert h100.flash3_efficiency == HARDWARE["h200"].flash3_efficiency == 0.75
    assert all(HARDWARE[n].flash3_efficiency is None for n in ("h20", "a100", "l40s"))
    ratio = h100.attention_efficiency / h100.flash3_efficiency
    for layout, rel in ((ParallelLayout(1, 1), 1e-9), (ParallelLayout(1, 8, strategy="ring"), 0.01)):
        flash = estimate(h100, layout, shape, P720, 50, compile=True)
        fa3 = estimate(h100, layout, shape, P720, 50, compile=True, attention="flash3")
        assert fa3.attention_s == pytest.approx(flash.attention_s * ratio, rel=rel)
        assert fa3.e2e_s < flash.e2e_s
        assert (fa3.inter_node_bytes, fa3.intra_node_bytes) == (flash.inter_node_bytes, flash.intra_node_bytes)
    one = ParallelLayout(1, 1)
    rest = lambda est: est.step_s - est.attention_s  # noqa: E731 (attention_s: a step's self-attention)
    flash, fa3 = (estimate(h100, one, shape, P720, 50, attention=a) for a in ("flash", "flash3"))
    assert rest(fa3) < rest(flash)  # the cross-attention is attention too
    l40s = HARDWARE["l40s"]
    assert estimate(l40s, one, shape, P480, 10, attention="flash3") == estimate(l40s, one, shape, P480, 10)
    with pytest.raises(ValueError, match="flash2"):
        estimate(h100, one, shape, P480, 10, attention="flash2")


def test_the_runs_attention_backend_maps_to_its_pricing():
    h100, l40s = HARDWARE["h100"], HARDWARE["l40s"]
    assert attention_pricing("auto", h100) == attention_pricing("flash3", h100) == "flash3"
    for backend in ("sdpa", "flash", "reference"):
        assert attention_pricing(backend, h100) == "flash"
    assert attention_pricing("auto", l40s) == "flash"  # auto picks FlashAttention-3 on Hopper only
    assert attention_pricing("flash3", l40s) == "flash3"  # priced at attention_efficiency there


def test_a_profile_file_may_carry_flash3_efficiency(tmp_path):
    old = {"name": "x", "bf16_tflops": 500.0, "hbm_tbps": 2.0, "intra_gbps": 300.0, "inter_gbps": 25.0, "latency_us": 5}
    path = tmp_path / "hw.json"
    for extra, expected in (({}, None), ({"flash3_efficiency": None}, None), ({"flash3_efficiency": 0.6}, 0.6)):
        path.write_text(json.dumps({**old, **extra}))
        assert load_hardware(str(path)).flash3_efficiency == expected
    for bad in (1.5, 0, "fast", True):
        path.write_text(json.dumps({**old, "flash3_efficiency": bad}))
        with pytest.raises(ValueError, match="flash3_efficiency"):
            load_hardware(str(path))


def test_the_search_and_layout_auto_price_the_runs_attention(runner, tmp_path, monkeypatch):
    import planner.search
    from planner.search import Problem, search

    shape = REGISTRY["wan2.1-14b"].shape
    problem = Problem(shape, P720, 50, 1, 8, batch=1, objective="latency", compile=True)
    flash, _ = search(HARDWARE["h100"], problem)
    fa3, _ = search(HARDWARE["h100"], replace(problem, attention="flash3"))
    assert fa3[0].e2e_s < flash[0].e2e_s
    with pytest.raises(ValueError, match="attention"):
        Problem(shape, P720, 50, 1, 8, attention="auto")
    seen = []
    real = planner.search.search
    monkeypatch.setattr(planner.search, "search", lambda hw, p: seen.append((hw.name, p.attention)) or real(hw, p))
    base = ["check", "--prompt", "a", "--steps", "3", "--height", "32", "--width", "64", "--frames", "5"]
    base += ["--device", "cpu", "--gpus", "2", "--executor", "local", "--layout", "auto"]
    for hardware, attention in (("h100", "auto"), ("h100", "sdpa"), ("l40s", "auto")):
        out = ["--out", str(tmp_path / f"{hardware}-{attention}")]
        result = runner.invoke(app, [*base, "--hardware", hardware, "--attention", attention, *out])
        assert result.exit_code == 0, result.stderr[-2000:]
    assert seen == [("h100", "flash3"), ("h100", "flash"), ("l40s", "flash")]


def test_the_search_leaves_out_weight_splitting_layouts_under_fp8():
    from planner.search import Problem, search

    shape = REGISTRY["wan2.1-14b"].shape
    problem = Problem(shape, P480, 10, 1, 8, quantize="fp8", compile=True)
    choices, _ = search(HARDWARE["h100"], problem)
    assert choices and not any(c.layout.strategy.splits_weights for c in choices)
    plain, _ = search(HARDWARE["h100"], replace(problem, quantize="none"))
    assert any(c.layout.strategy.splits_weights for c in plain)
    with pytest.raises(ValueError, match="fp8"):
        search(Hardware("old", 312.0, 2.0, 300.0, 25.0, 10.0), problem)
