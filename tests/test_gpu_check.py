"""The CPU-checkable parts of benchmarks/gpu_check.py, at small sizes: the same code and limits
the GPU acceptance script applies, so a broken check is found here before a GPU session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import PARITY_CONFIG

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_kernel_contract_on_cpu():
    rows = gpu_check.kernel_rows(
        device="cpu",
        backends=["sdpa", "reference"],
        dtypes=(torch.float32, torch.bfloat16),
        head_dims=(48, 8),
        lengths=(33, 100),
    )
    # 2 dtypes x 2 head dims x 4 cases x (5 rows for sdpa + 6 for reference: against sdpa too)
    assert len(rows) == 16 * 11
    bad = [r for r in rows if not r.ok]
    assert not bad, bad[:3]


def test_kernel_contract_fails_a_wrong_state(monkeypatch):
    """The limits are tight enough to fail a wrong answer: an lse off by 0.01 fails."""
    from benchmarks.gpu import kernel_checks
    from runtime import kernels
    from runtime.state import AttentionState

    real = kernels.attention

    def wrong(q, k, v, scale, backend):
        state = real(q, k, v, scale, backend)
        return AttentionState(state.out_BSHD, state.lse_BSH + 0.01)

    monkeypatch.setattr(kernel_checks, "attention", wrong)
    rows = gpu_check.kernel_rows(device="cpu", backends=["sdpa"], dtypes=(torch.float32,), head_dims=(8,))
    assert any(not r.ok and "lse vs float64" in r.check for r in rows)


TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=PARITY_CONFIG.heads,
    attention_head_dim=PARITY_CONFIG.head_dim,
    in_channels=4,
    out_channels=4,
    text_dim=PARITY_CONFIG.text_dim,
    freq_dim=16,
    ffn_dim=PARITY_CONFIG.ffn_dim,
    num_layers=PARITY_CONFIG.layers,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=64,
)


def processor_row(dtype: torch.dtype, rel_tol: float):
    (row,) = gpu_check.processor_rows(
        device="cpu", config=TINY, latent_shape=(3, 8, 10), dtype=dtype, text_len=7, rel_tol=rel_tol, reps=1
    )
    return row


def test_processor_matches_diffusers_on_cpu():
    """Section 3 at a tiny geometry: our processor (one rank) against diffusers'. In float32 on
    the CPU both call the same fused kernel on the same float32 rotary tables."""
    row = processor_row(torch.float32, 1e-5)
    assert row.ok and row.value <= 1e-5, row
    # bf16 with the float32 modules diffusers keeps (rope, norms): within bf16 rounding.
    row = processor_row(torch.bfloat16, 2e-2)
    assert row.ok, row


def test_processor_check_fails_a_wrong_rotation(monkeypatch):
    from runtime.models import wan

    monkeypatch.setattr(wan, "apply_rotary", lambda x, cos, sin: x)
    row = processor_row(torch.float32, 1e-5)
    assert not row.ok and row.value > 1e-3, row


def test_one_rank_world_bring_up_on_gloo():
    """Section 2's mesh and warm-up, over gloo. The bug: warm-up compared the control group's
    sum with the layout's world size (4) in a one-rank world, so the section always raised."""
    rows = gpu_check.nccl_rows(device="cpu", backend="gloo")
    assert [r.check for r in rows] == ["warm-up of every group of a 4-member mesh", "Comm.all_gather_seq over one rank"]
    assert all(r.ok for r in rows), rows


SMALL_CACHE = dict(layers=3, heads=4, head_dim=8, tokens=4 * 64, cp=8, group=2, branches=2)


def test_cache_section_on_cpu():
    """Section 4 at a small shape: buffers equal the formula, a cap composes, and nothing is
    held after the item. The bug: the planner statistics outlived end_run."""
    rows = gpu_check.cache_rows(device="cpu", shape=SMALL_CACHE, name="small")
    assert len(rows) == 4 and all(r.ok for r in rows), rows


def test_cache_section_fails_buffers_kept_after_the_item(monkeypatch):
    from runtime.strategies.selective import SelectiveRuntime

    monkeypatch.setattr(SelectiveRuntime, "end_run", lambda self: None)
    rows = gpu_check.cache_rows(device="cpu", shape=SMALL_CACHE, name="small")
    (left,) = [r for r in rows if "after the item" in r.check]
    assert not left.ok and left.value > 0, left


def test_rope_tables_are_not_rounded_through_bf16():
    """The check cast the whole model to bf16 and the float32 modules back: the rotary tables
    (buffers) came back rounded. As from_pretrained leaves them, they keep their values."""
    from diffusers import WanTransformer3DModel

    from benchmarks.gpu.runtime_checks import random_wan

    fresh = WanTransformer3DModel(**TINY)
    cast, _ = random_wan(TINY, (1, 2, 2), 4, torch.bfloat16, "cpu")  # what every GPU check builds
    for name, table in fresh.rope.named_buffers():
        assert torch.equal(getattr(cast.rope, name), table), name
    assert cast.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16
    assert cast.blocks[0].norm2.weight.dtype == torch.float32  # a module diffusers keeps in float32


def test_generate_runs_locally_and_a_hung_run_fails_its_row(monkeypatch):
    """The generate section runs `--executor local` (on a Slurm node `auto` submitted a job) and
    bounds each run: a run that does not end is a failed row, not a hung check."""
    import subprocess

    calls = []

    def hung(args, **kwargs):
        calls.append((args, kwargs))
        raise subprocess.TimeoutExpired(args, kwargs.get("timeout"))

    monkeypatch.setattr(gpu_check.subprocess, "run", hung)
    rows = gpu_check.generate_rows()
    assert rows and not any(r.ok for r in rows)
    assert all(kw.get("timeout") == gpu_check.GENERATE_TIMEOUT_S for _, kw in calls)
    assert all(args[args.index("--executor") + 1] == "local" for args, _ in calls)


SMALL_WAN = dict(TINY, num_layers=2)


def test_sharding_section_on_cpu():
    """FSDP2 and DTensor TP on a one-rank gloo mesh (the runtime skips both on one rank)."""
    from benchmarks.gpu.model_checks import sharding_rows

    rows = sharding_rows(device="cpu", backend="gloo", config=SMALL_WAN, latent_shape=(2, 8, 8), text_len=7)
    assert len(rows) == 3 and all(r.ok for r in rows), rows


def test_sharding_section_fails_when_nothing_is_split(monkeypatch):
    from benchmarks.gpu.model_checks import sharding_rows
    from runtime.models import wan

    monkeypatch.setattr(wan, "install_tp", lambda transformer, tp: ([], []))
    rows = sharding_rows(device="cpu", backend="gloo", config=SMALL_WAN, latent_shape=(2, 8, 8), text_len=7)
    assert any(not r.ok and "DTensor TP" in r.check for r in rows), rows


@pytest.mark.e2e
def test_memory_section_on_cpu(monkeypatch):
    """The memory model against a traced peak at small sizes; a model off by 2x fails."""
    from benchmarks.gpu import model_checks

    small = dict(device="cpu", heads=4, head_dim=64, ffn=1024, tokens=2048, text_len=64, video=(64, 96, 9))
    rows = model_checks.memory_rows(**small)
    assert len(rows) == 3 and all(r.ok for r in rows), rows
    import planner.decode_memory

    real = planner.decode_memory.decode_bytes
    monkeypatch.setattr(planner.decode_memory, "decode_bytes", lambda *a, **k: 2 * real(*a, **k))
    rows = model_checks.memory_rows(**small)
    assert [r.ok for r in rows] == [True, False, False], rows


def compile_section(**kwargs):
    from benchmarks.gpu.compile_checks import compile_rows

    return compile_rows(
        device="cpu", config=TINY, latent_shape=(3, 8, 10), dtype=torch.float32, text_len=7, reps=1, **kwargs
    )


def test_compile_section_on_cpu():
    """Section 8 traced by dynamo alone ("eager" backend): the ring's block compiles whole
    through the custom ops, one graph for the blocks, and the traced graphs give the eager
    output exactly; the speed row is only printed on a CPU."""
    rows = compile_section(backend="eager", rel_tol=1e-6)
    assert [r.limit for r in rows] == ["0, no fallback", "1..2", "<= 1e-06", "-"], rows
    breaks, graphs, err, speed = rows
    assert breaks.ok and breaks.value == 0, breaks
    assert graphs.ok and f"for {TINY['num_layers']} blocks" in graphs.check, graphs
    assert err.ok and err.value <= 1e-6, err
    assert speed.value > 0 and "time per forward" in speed.check, speed


def test_compile_section_fails_a_graph_break(monkeypatch):
    """A block that breaks the graph (an attention call dynamo cannot trace) fails the row."""
    from runtime.models import wan

    real = wan.attend

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return real(*args, **kwargs)

    monkeypatch.setattr(wan, "attend", breaking)
    breaks = compile_section(backend="eager", rel_tol=1e-6)[0]
    assert not breaks.ok and breaks.value >= 1, breaks


# Widths in multiples of 16, so fp8 quantizes every block Linear.
FP8_WAN = dict(TINY, num_attention_heads=2, attention_head_dim=16, text_dim=32, ffn_dim=64, num_layers=2)
FP8_SHAPES = ((256, 512, 1024), (64, 1024, 256))


def fp8_section():
    from benchmarks.gpu.fp8_checks import fp8_rows

    return fp8_rows(
        device="cpu", shapes=FP8_SHAPES, config=FP8_WAN, latent_shape=(3, 8, 10), text_len=7, backend="eager", reps=1
    )


def test_fp8_section_on_cpu():
    """Section 9's error half on the CPU (torch._scaled_mm runs there): each shape's error, eager
    and compiled times (printed, no limit), then the whole model in fp8 against bf16."""
    from benchmarks.gpu.fp8_checks import LINEAR_TOL, MODEL_TOL

    rows = fp8_section()
    assert len(rows) == 3 * len(FP8_SHAPES) + 1 and all(r.ok for r in rows), rows
    errors = [r for r in rows if "relative L2" in r.check]
    assert [r.limit for r in errors] == [f"<= {LINEAR_TOL:g}"] * 2 + [f"<= {MODEL_TOL:g}"], errors
    # quantized, so not exact, and within e4m3's rounding
    assert all(1e-3 < r.value <= LINEAR_TOL for r in errors), errors
    assert "20 layers in fp8 (0 skipped)" in errors[-1].check, errors[-1]
    times = [r for r in rows if "time" in r.check]
    assert len(times) == 4 and all(r.limit == "-" and r.value > 0 for r in times), times


def test_fp8_section_fails_a_wrong_scale(monkeypatch):
    """Scales 10% too large (weights and activations) give ~20% error: every error row fails."""
    from runtime import quantize

    real = quantize.quantize_rows

    def wrong(x):
        x_fp8, scale = real(x)
        return x_fp8, scale * 1.1

    monkeypatch.setattr(quantize, "quantize_rows", wrong)
    errors = [r for r in fp8_section() if "relative L2" in r.check]
    assert len(errors) == 3 and not any(r.ok for r in errors), errors


def test_fp8_section_is_one_line_below_compute_capability_8_9(monkeypatch):
    from benchmarks.gpu.fp8_checks import fp8_rows, fp8_skip_reason

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    (row,) = fp8_rows(device="cuda")
    assert row.ok and row.check.startswith("skipped: compute capability 8.0 < 8.9"), row
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_skip_reason("cuda") is None
