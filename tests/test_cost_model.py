"""The cost model's byte counts equal the runtime's counters exactly (4 ranks, 2 virtual
nodes, every strategy), and `ditango simulate` prints its table and JSON."""

from __future__ import annotations

import json

import pytest

from planner.cost_model import HARDWARE, estimate
from planner.ditango import DiTangoOptions, PlannerConfig
from planner.layout import ParallelLayout, virtual_node_map
from planner.models import ModelShape
from planner.traffic import plan_bits_from_log, predict_traffic
from runtime.comm import Comm
from runtime.guidance import CfgParallel, SequentialCfg
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from runtime.pipeline import WanDenoiser
from runtime.run import sum_comm
from runtime.strategies import parallelize
from slurm.local import run_ranks
from tests.test_cp_pipeline import CP_MODEL, TEXT_LEN
from tiny_wan import build_tiny_wan

SHAPE = ModelShape("cp-test", layers=CP_MODEL.layers, heads=CP_MODEL.heads, head_dim=CP_MODEL.head_dim,
                   ffn=CP_MODEL.ffn_dim, text_len=TEXT_LEN, text_dim=CP_MODEL.text_dim)  # fmt: skip
H, W, F, STEPS = 48, 80, 5, 6
OPTS = DiTangoOptions(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1))
RUNS = [  # name, layout kwargs, ditango options
    ("ring", dict(strategy="ring"), None),
    ("ulysses", dict(strategy="ulysses"), None),
    ("usp", dict(strategy="usp", ulysses_degree=2), None),
    ("ditango", dict(strategy="ditango", group_size=2), OPTS),
    ("ditango_g1", dict(strategy="ditango", group_size=1), OPTS),
    ("cfg_ring", dict(strategy="ring", cfg_degree=2), None),
]


def _target(rank, world, events):
    denoiser = WanDenoiser(build_tiny_wan(CP_MODEL), resolve_placement("cpu"), TEXT_LEN)
    out = {}
    for name, kwargs, opts in RUNS:
        layout = ParallelLayout(nodes=2, gpus_per_node=2, **kwargs)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=90)
        comm = Comm(mesh)
        handle = parallelize(denoiser.transformers, mesh, comm, "torch", opts)
        denoiser.listener = handle
        denoiser.guidance = CfgParallel(mesh, comm) if layout.cfg_degree == 2 else SequentialCfg()
        text = denoiser.encode_text("a yellow circle moving down", "blurry", 4.0)
        denoiser.denoise(denoiser.initial_latents(5, H, W, F), text, STEPS, 4.0)
        log = handle.ctx.selective.item_report()["plan_log"] if handle.ctx.selective else None
        handle.remove()
        out[name] = (comm.totals(), log)
    return out


def test_byte_predictions_equal_runtime_counters():
    per_rank = run_ranks(_target, 4, timeout_s=120)
    for name, kwargs, _ in RUNS:
        measured = sum_comm([per_rank[r][name][0] for r in range(4)])
        layout = ParallelLayout(nodes=2, gpus_per_node=2, **kwargs)
        bits = kinds = None
        if layout.strategy == "ditango":
            logs = {json.dumps(per_rank[r][name][1], sort_keys=True) for r in range(4)}
            assert len(logs) == 1  # one plan on every rank
            bits = plan_bits_from_log(per_rank[0][name][1], SHAPE.layers, branches=2)
            kinds = [step["kind"] for step in per_rank[0][name][1]["steps"]]
            assert not all(all(all(row) for row in f) for f in bits)  # the plan reused something
        predicted = predict_traffic(layout, SHAPE, H, W, F, STEPS, element_bytes=4, plan_bits=bits, plan_kinds=kinds)
        assert predicted == measured, name
        assert measured["inter_node_bytes"] > 0


def test_estimates_are_ordered_sensibly():
    shape = ModelShape("wan2.1-14b", layers=40, heads=40, head_dim=128, ffn=13824, text_len=512)
    hw = HARDWARE["h20"]
    one = estimate(hw, ParallelLayout(1, 8, strategy="ring"), shape, 720, 1280, 81, 50)
    four = estimate(hw, ParallelLayout(4, 8, strategy="ring"), shape, 720, 1280, 81, 50)
    assert four.e2e_s < one.e2e_s and four.inter_node_bytes > 0 == one.inter_node_bytes
    exact = estimate(hw, ParallelLayout(4, 8, strategy="ditango", group_size=8), shape, 720, 1280, 81, 50)
    reuse = estimate(hw, ParallelLayout(4, 8, strategy="ditango", group_size=8), shape, 720, 1280, 81, 50,
                     compute_fraction=0.5)  # fmt: skip
    assert reuse.attention_s < exact.attention_s


def test_simulate_cli(runner, tmp_path):
    from ditango_cli.app import app

    args = ["simulate", "--model", "wan2.1-14b", "--nodes", "4", "--gpus-per-node", "8", "--hardware", "h20",
            "--height", "720", "--width", "1280", "--frames", "81", "--steps", "50", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == 1 and "hardware" in data["assumptions"]
    rows = data["rows"]
    assert {r["strategy"] for r in rows} >= {"ring", "usp", "ditango"}
    assert {r["nodes"] for r in rows} == {1, 2, 3, 4}
    for r in rows:
        assert set(r) >= {"strategy", "nodes", "gpus_per_node", "attention_s", "step_s", "e2e_s",
                          "inter_node_bytes", "intra_node_bytes", "speedup_vs_best_exact"}  # fmt: skip
        assert r["e2e_s"] > 0
    table = runner.invoke(app, args[:-1])
    assert table.exit_code == 0 and "ditango" in table.stdout


@pytest.mark.parametrize("bad,needle", [(["--hardware", "tpu9"], "tpu9"), (["--model", "nope"], "unknown model")])
def test_simulate_bad_input(runner, bad, needle):
    from ditango_cli.app import app

    result = runner.invoke(app, ["simulate", "--nodes", "2", *bad])
    assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.stderr


def test_hardware_profile_file(tmp_path):
    from planner.cost_model import load_hardware
    from planner.errors import ConfigError

    f = tmp_path / "gpu.json"
    f.write_text(json.dumps({"name": "x", "bf16_tflops": 500.0, "hbm_tbps": 3.0, "intra_gbps": 400.0,
                             "inter_gbps": 40.0, "latency_us": 8.0, "measured": {"anything": 1}}))  # fmt: skip
    hw = load_hardware(str(f))
    assert (hw.name, hw.bf16_tflops, hw.inter_gbps) == ("x", 500.0, 40.0)
    f.write_text("{not json")
    with pytest.raises(ConfigError):
        load_hardware(str(f))


def test_fractional_plan_bytes_interpolate_exact_counts():
    """A fraction of 0 or 1 per offset must give exactly the counts of an all-reuse or
    all-compute plan; the mapping keeps near offsets near."""
    from planner.cost_model import map_plan_offsets

    shape = SHAPE
    layout = ParallelLayout(nodes=2, gpus_per_node=2, strategy="ditango", group_size=1)  # 3 remote offsets
    hw = HARDWARE["h100"]
    forwards = STEPS * 2
    for f in ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]):
        est = estimate(hw, layout, shape, H, W, F, STEPS, compute_fraction=f, element_bytes=4)
        bits = [[[bool(x) for x in f] for _ in range(shape.layers)] for _ in range(forwards)]
        exact = predict_traffic(layout, shape, H, W, F, STEPS, element_bytes=4, plan_bits=bits)
        assert (est.inter_node_bytes, est.intra_node_bytes) == (exact["inter_node_bytes"], exact["intra_node_bytes"])
    log = {"steps": [{"compute": ["10", "10"]}, {"compute": ["11", "00"]}]}  # unit 0: 3/4, unit 1: 1/4
    assert map_plan_offsets(log, 5) == [0.75, 0.75, 0.25, 0.25]
    assert map_plan_offsets(log, 2) == [0.75]


def test_simulate_maps_a_plan_file_by_offset(runner, tmp_path):
    from ditango_cli.app import app

    plan = {"schema": 1, "format": "x", "steps": [{"compute": ["1"] * 4}, {"compute": ["0"] * 4}]}
    (tmp_path / "a.plan.json").write_text(json.dumps(plan))
    report = {"items": [{"attention": {"per_step": [1.0, 0.0], "plan_file": "a.plan.json"}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    args = ["simulate", "--nodes", "2", "--gpus-per-node", "8", "--plan", str(tmp_path / "report.json"), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert "per ring offset" in data["assumptions"]["ditango_plan"]
    rows = {(r["strategy"], r["nodes"]): r for r in data["rows"]}
    # Half the remote attention computed: fewer inter-node bytes than USP's exact all-to-all + ring.
    assert rows["ditango", 2]["inter_node_bytes"] < rows["ring", 2]["inter_node_bytes"]
