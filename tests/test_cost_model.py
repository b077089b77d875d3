"""The cost model's byte counts equal the runtime's counters exactly (4 ranks, 2 virtual
nodes, every strategy); DiTango is priced from plans its planners make (recorded shapes,
or a run's plan file), by decision unit and each offset's slowest rank; and `ditango
simulate` prints its table and JSON."""

from __future__ import annotations

import json
import re

import pytest
import torch

from planner.cost_model import HARDWARE, estimate
from planner.ditango import DiTangoOptions, DiTangoPlanner, PlannerConfig
from planner.layout import ParallelLayout, virtual_node_map
from planner.models import ModelShape, VideoSize
from planner.plan import KINDS
from planner.traffic import ditango_units, plan_bits_from_log, predict_traffic
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.item_records import sum_comm
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from slurm.launchers.processes import run_ranks
from tests.test_cp_pipeline import CP_MODEL, TEXT_LEN
from tiny_wan import build_tiny_wan

SHAPE = ModelShape(
    "cp-test",
    layers=CP_MODEL.layers,
    heads=CP_MODEL.heads,
    head_dim=CP_MODEL.head_dim,
    ffn=CP_MODEL.ffn_dim,
    text_len=TEXT_LEN,
    text_dim=CP_MODEL.text_dim,
)
H, W, F, STEPS = 48, 80, 5, 6
SIZE = VideoSize(H, W, F)
BYTE_KEYS = ("inter_node_bytes", "intra_node_bytes")
OPTS = DiTangoOptions(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1))
RUNS = [  # name, layout kwargs, ditango options
    ("ring", dict(strategy="ring"), None),
    ("ulysses", dict(strategy="ulysses"), None),
    ("usp", dict(strategy="usp", ulysses_degree=2), None),
    ("ditango", dict(strategy="ditango", group_size=2), OPTS),
    ("ditango_g1", dict(strategy="ditango", group_size=1), OPTS),
    ("cfg_ring", dict(strategy="ring", cfg_degree=2), None),
    ("tp", dict(strategy="tp"), None),  # tensor parallel: ring all-reduces, counted from DTensor's layers
    ("cfg_tp", dict(strategy="tp", cfg_degree=2), None),
]


def _target(rank, world, events):
    components = build_tiny_wan(CP_MODEL)
    out = {}
    for name, kwargs, opts in RUNS:
        layout = ParallelLayout(nodes=2, gpus_per_node=2, **kwargs)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=90)
        comm = Comm(mesh)
        denoiser = build_denoiser(components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm, ditango=opts)
        text = denoiser.encode_text("a yellow circle moving down", "blurry", 4.0)
        denoiser.denoise(denoiser.initial_latents(5, H, W, F), text, STEPS, 4.0)
        log = denoiser.ditango.item_report()["plan_log"] if denoiser.ditango else None
        denoiser.parallel.remove()
        out[name] = (comm.totals(), log)
    return out


@pytest.mark.distributed
def test_byte_predictions_equal_runtime_counters():
    per_rank = run_ranks(_target, 4, timeout_s=120)
    for name, kwargs, _ in RUNS:
        measured = sum_comm([per_rank[r][name][0] for r in range(4)])
        layout = ParallelLayout(nodes=2, gpus_per_node=2, **kwargs)
        bits = kinds = None
        if layout.strategy.reuses:
            logs = {json.dumps(per_rank[r][name][1], sort_keys=True) for r in range(4)}
            assert len(logs) == 1  # one plan on every rank
            bits = plan_bits_from_log(per_rank[0][name][1], SHAPE.layers, branches=2)
            kinds = [step["kind"] for step in per_rank[0][name][1]["steps"]]
            assert not all(all(all(row) for row in f) for f in bits)  # the plan reused something
        predicted = predict_traffic(layout, SHAPE, SIZE, STEPS, element_bytes=4, plan_bits=bits, plan_kinds=kinds)
        assert predicted == measured, name
        assert measured["inter_node_bytes"] > 0


def test_estimates_are_ordered_sensibly():
    shape = ModelShape("wan2.1-14b", layers=40, heads=40, head_dim=128, ffn=13824, text_len=512)
    hw = HARDWARE["h20"]
    one = estimate(hw, ParallelLayout(1, 8, strategy="ring"), shape, VideoSize(720, 1280, 81), 50)
    four = estimate(hw, ParallelLayout(4, 8, strategy="ring"), shape, VideoSize(720, 1280, 81), 50)
    assert four.e2e_s < one.e2e_s and four.inter_node_bytes > 0 == one.inter_node_bytes
    exact = estimate(hw, ParallelLayout(4, 8, strategy="ditango", group_size=8), shape, VideoSize(720, 1280, 81), 50)
    reuse = estimate(
        hw,
        ParallelLayout(4, 8, strategy="ditango", group_size=8),
        shape,
        VideoSize(720, 1280, 81),
        50,
        compute_fraction=0.5,
    )
    assert reuse.attention_s < exact.attention_s


def test_simulate_cli(runner, tmp_path):
    from ditango_cli.app import app

    args = [
        "simulate",
        "--model",
        "wan2.1-14b",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--hardware",
        "h20",
        "--height",
        "720",
        "--width",
        "1280",
        "--frames",
        "81",
        "--steps",
        "50",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == 1 and "hardware" in data["assumptions"]
    assumptions = data["assumptions"]
    assert "plan_shapes.json" in assumptions["ditango_plan"] and assumptions["ditango_planner"] == "hpdc"
    assert (assumptions["ditango_cache_ratio"], assumptions["ditango_own_group"]) == (0.4, "decide")
    rows = data["rows"]
    assert {r["strategy"] for r in rows} >= {"ring", "usp", "ditango"}
    assert {r["nodes"] for r in rows} == {1, 2, 3, 4}
    for r in rows:
        assert set(r) >= {
            "strategy",
            "nodes",
            "gpus_per_node",
            "attention_s",
            "step_s",
            "e2e_s",
            "inter_node_bytes",
            "intra_node_bytes",
            "speedup_vs_best_exact",
        }
        assert r["e2e_s"] > 0
        assert ("ditango" in r) == (r["strategy"] == "ditango")
    table = runner.invoke(app, args[:-1])
    assert table.exit_code == 0 and "ditango" in table.stdout and "note: hpdc plan shape" in table.stdout


def test_simulate_lists_tp_where_it_splits_the_heads(runner):
    """tp is priced like the other exact strategies; a node count whose tp degree does not
    divide the heads (40 over 12 ranks) is a skipped note, not a row."""
    from ditango_cli.app import app

    args = [
        "simulate",
        "--model",
        "wan2.1-14b",
        "--nodes",
        "3",
        "--gpus-per-node",
        "4",
        "--parallel",
        "ring,tp",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    tp = {r["nodes"]: r for r in data["rows"] if r["strategy"] == "tp"}
    assert set(tp) == {1, 2} and all(r["speedup_vs_best_exact"] is not None for r in tp.values())
    assert tp[1]["inter_node_bytes"] == 0 < tp[2]["inter_node_bytes"]
    assert any(n.startswith("tp on 3 node(s): tp degree 12 must divide") for n in data["assumptions"]["skipped"])
    assert "tp" in data["assumptions"]  # its pricing assumptions


def test_simulate_plumbs_planner_and_own_group(runner):
    """--planner budget prices selective steps at its quota, 1 - r of the layout's cells (to
    within the rounding of one step's 40 x U cells), where the hpdc shape computes about a
    third; --own-group fresh drops unit 0, so one node has nothing to decide."""
    from ditango_cli.app import app
    from planner.plan_shape import load_plan_shapes

    recorded = load_plan_shapes()["budget"][0]  # warm-up and cool-down default to the recorded runs'
    base = [
        "simulate",
        "--nodes",
        "3",
        "--gpus-per-node",
        "8",
        "--parallel",
        "ditango",
        "--group-size",
        "node",
        "--json",
    ]
    data = json.loads(runner.invoke(app, [*base, "--planner", "budget", "--cache-ratio", "0.33"]).stdout)
    assert (data["assumptions"]["ditango_planner"], data["assumptions"]["ditango_cache_ratio"]) == ("budget", 0.33)
    for r in data["rows"]:
        cells = 40 * r["nodes"]  # wan2.1-14b: 40 layers; units: the partner and nodes - 1 offsets
        assert abs(r["ditango"]["computed_fraction_selective"] - 0.67) <= 1 / cells
        steps = r["ditango"]["steps"]
        assert steps["exact"] == recorded.warmup + recorded.cooldown and sum(steps.values()) == 50
    fresh = json.loads(runner.invoke(app, [*base, "--own-group", "fresh"]).stdout)
    assert fresh["assumptions"]["ditango_own_group"] == "fresh"
    one = next(r for r in fresh["rows"] if r["nodes"] == 1)
    assert one["ditango"]["computed_fraction_all_steps"] == 1.0 and one["ditango"]["steps"]["exact"] == 50


@pytest.mark.parametrize("bad,needle", [(["--hardware", "tpu9"], "tpu9"), (["--model", "nope"], "unknown model")])
def test_simulate_bad_input(runner, bad, needle):
    from ditango_cli.app import app

    result = runner.invoke(app, ["simulate", "--nodes", "2", *bad])
    assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.stderr


def test_hardware_profile_file(tmp_path):
    from basics.errors import ConfigError
    from planner.cost_model import load_hardware

    f = tmp_path / "gpu.json"
    f.write_text(
        json.dumps(
            {
                "name": "x",
                "bf16_tflops": 500.0,
                "hbm_tbps": 3.0,
                "intra_gbps": 400.0,
                "inter_gbps": 40.0,
                "latency_us": 8.0,
                "measured": {"anything": 1},
            }
        )
    )
    hw = load_hardware(str(f))
    assert (hw.name, hw.bf16_tflops, hw.inter_gbps) == ("x", 500.0, 40.0)
    f.write_text("{not json")
    with pytest.raises(ConfigError):
        load_hardware(str(f))
    good = {
        "name": "x",
        "bf16_tflops": 500.0,
        "hbm_tbps": 3.0,
        "intra_gbps": 400.0,
        "inter_gbps": 40.0,
        "latency_us": 8.0,
    }
    for bad, needle in [
        ({"bf16_tflops": 0}, "bf16_tflops must be a positive number"),
        ({"inter_gbps": "fast"}, "inter_gbps must be"),
        ({"intra_gbps": float("nan")}, "intra_gbps"),
        ({"memory_bytes": -5}, "memory_bytes"),
        ({"name": [1]}, "name must be a string"),
        ({"fast": True}, "unknown key(s) fast"),
    ]:
        f.write_text(json.dumps({**good, **bad}))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_hardware(str(f))


def test_fractional_plan_bytes_interpolate_exact_counts():
    """A fraction of 0 or 1 per unit must give exactly the counts of a plan computing those
    units always or never, with and without the own-group unit; the mapping keeps near
    offsets near."""
    from planner.plan_shape import map_offsets

    hw = HARDWARE["h100"]
    forwards = STEPS * 2
    cases = [
        (1, ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0])),  # group 1: 3 remote offsets
        (2, ([1.0, 0.0], [0.0, 1.0], [0.0, 0.0])),
    ]  # group 2: unit 0 (partner), offset 1
    for group, fractions in cases:
        layout = ParallelLayout(nodes=2, gpus_per_node=2, strategy="ditango", group_size=group)
        for f in fractions:
            est = estimate(hw, layout, SHAPE, SIZE, STEPS, compute_fraction=f, element_bytes=4)
            bits = [[[bool(x) for x in f] for _ in range(SHAPE.layers)] for _ in range(forwards)]
            exact = predict_traffic(layout, SHAPE, SIZE, STEPS, element_bytes=4, plan_bits=bits)
            assert [est.inter_node_bytes, est.intra_node_bytes] == [exact[k] for k in BYTE_KEYS], (group, f)
    assert map_offsets((0.75, 0.25), 5) == [0.75, 0.75, 0.25, 0.25]
    assert map_offsets((0.75, 0.25), 2) == [0.75]
    assert map_offsets((0.9, 0.5, 0.1), 3) == [0.9, 0.1]  # nearest to nearest, farthest to farthest


def _planned(cfg: PlannerConfig, steps: int, layers: int, units: int) -> dict:
    """A plan file made by the real planner, fed seeded random scores and gates."""
    p = DiTangoPlanner(cfg, steps, layers, units)
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        if p.observes(p.plan(step).kind):
            p.observe(step, torch.rand(layers, units, generator=g), 0.35 * float(torch.rand((), generator=g)))
    return p.log().to_json()


def _write_run(root, plan_log: dict | None, planner: str, cache_ratio: float, per_step=(1.0, 0.5)):
    """A run directory as `ditango generate` leaves it: report.json and its plan file."""
    attention = {"per_step": list(per_step), "planner": planner, "own_group": "decide"}
    if plan_log is not None:
        (root / "a.plan.json").write_text(json.dumps({"schema": 1, **plan_log}))
        attention["plan_file"] = "a.plan.json"
    report = {"options": {"cache_ratio": cache_ratio}, "items": [{"attention": attention}]}
    (root / "report.json").write_text(json.dumps(report))
    return root / "report.json"


@pytest.mark.parametrize("planner", ["hpdc", "budget"])
def test_replaying_a_runs_own_plan_gives_its_exact_bytes(tmp_path, planner):
    """A run's plan (report.json + plan file) replayed on its own layout and step count moves
    exactly the bytes of that plan bit for bit (predict_traffic), control plane included."""
    from planner.plan_shape import report_source

    layout = ParallelLayout(nodes=2, gpus_per_node=4, strategy="ditango", group_size=2)  # partner + 3 offsets
    units = ditango_units(layout, "decide")
    steps = 16
    cfg = PlannerConfig(cache_ratio=0.5, warmup=2, cooldown=2, planner=planner)
    log = {**_planned(cfg, steps, SHAPE.layers, len(units)), "unit_offsets": [list(u) for u in units]}
    kinds = [s["kind"] for s in log["steps"]]
    assert kinds.count("anchor") >= 1 and kinds.count("selective") >= 5
    source = report_source(_write_run(tmp_path, log, planner, 0.5))  # warm-up, cool-down: the run's (2, 2)
    plan = source.replay(layout, SHAPE.layers, steps)
    assert (plan.exact, plan.anchors, plan.selective) == tuple(kinds.count(k) for k in ("exact", "anchor", "selective"))
    est = estimate(
        HARDWARE["h100"],
        layout,
        SHAPE,
        SIZE,
        steps,
        compute_fraction=plan.unit_fractions,
        element_bytes=4,
        plan_kinds=plan.kinds,
        planner=planner,
    )
    bits = plan_bits_from_log(log, SHAPE.layers, branches=2)
    exact = predict_traffic(
        layout, SHAPE, SIZE, steps, element_bytes=4, plan_bits=bits, plan_kinds=kinds, planner=planner
    )
    every = predict_traffic(layout, SHAPE, SIZE, steps, element_bytes=4, plan_kinds=kinds, planner=planner)
    assert [est.inter_node_bytes, est.intra_node_bytes] == [exact[k] for k in BYTE_KEYS]
    assert exact["inter_node_bytes"] < every["inter_node_bytes"]  # the plan reused something


def test_default_price_replays_the_recorded_hpdc_shape(runner):
    """Bug guarded: without --plan, DiTango was priced at 1 - cache_ratio computed on selective
    steps, a plan the hpdc planner does not make (its threshold is a quantile of the first
    selective step, and the drift grows after it). On the recording's own layout (4 nodes x
    1 GPU, group 1, 50 steps) the default now replays the recorded run."""
    from ditango_cli.app import app
    from planner.plan_shape import PLAN_SHAPES_FILE

    recorded = json.loads(PLAN_SHAPES_FILE.read_text(encoding="utf-8"))
    shape = next(s for s in recorded["shapes"]["hpdc"] if s["cache_ratio"] == 0.8)
    assert shape["selective_fraction"] > 0.25  # well above the 1 - 0.8 the old price assumed
    args = [
        "simulate",
        "--nodes",
        "4",
        "--gpus-per-node",
        "1",
        "--group-size",
        "1",
        "--parallel",
        "ring,ditango",
        "--cache-ratio",
        "0.8",
        "--steps",
        "50",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    row = next(r for r in json.loads(result.stdout)["rows"] if r["strategy"] == "ditango" and r["nodes"] == 4)
    assert row["ditango"]["steps"] == shape["steps"]
    assert row["ditango"]["computed_fraction_selective"] == pytest.approx(shape["selective_fraction"], abs=1e-4)
    old = (11 + 39 * (1 - 0.8)) / 50  # exact warm-up/cool-down and one anchor, then 1 - cache_ratio
    assert row["ditango"]["computed_fraction_all_steps"] > old + 0.05


def test_budget_replay_computes_what_the_budget_planner_computes():
    """The budget planner's selective total is its quota, not a recorded figure: the replay's
    step kinds and computed cells equal those of the real budget planner over the same 50
    steps, 40 layers and 4 units (fed random scores: which cells it takes does not change how
    many), between and outside the recorded ratios, so the all-steps fraction is exactly
    (exact + anchors + selective x budget) / steps. A stale planner/plan_shapes.json (the
    planner's anchoring changed since) fails here: rerun benchmarks/plan_shapes.py."""
    from planner.plan_shape import load_plan_shapes, replay

    layout = ParallelLayout(4, 8, strategy="ditango", group_size=8)  # partner + 3 remote offsets
    layers, units, steps = 40, 4, 50
    shapes = load_plan_shapes()["budget"]
    w, c = shapes[0].warmup, shapes[0].cooldown  # as generate ran the recordings
    for r in (0.33, 0.55, 0.95):
        plan = replay(shapes, layout, layers, steps, r, warmup=w, cooldown=c)
        log = _planned(PlannerConfig(cache_ratio=r, warmup=w, cooldown=c, planner="budget"), steps, layers, units)
        kinds = [s["kind"] for s in log["steps"]]
        assert (plan.exact, plan.anchors, plan.selective) == tuple(kinds.count(k) for k in KINDS), r
        computed = sum(row.count("1") for s in log["steps"] if s["kind"] == "selective" for row in s["compute"])
        budget = computed / (plan.selective * layers * units)
        every = plan.unit_fractions
        expected = (plan.exact + plan.anchors + plan.selective * budget) / steps
        assert sum(every) / len(every) == pytest.approx(expected, rel=0, abs=1e-12)
        assert max(plan.selective_U) <= 1.0 and abs(budget - (1 - r)) < 0.01
        assert any("recorded for cache ratios" in n for n in plan.notes) == (r == 0.95)


def test_shapes_interpolate_between_recorded_ratios_and_clamp_outside():
    from planner.plan_shape import PlanShape, _scale_to_mean, replay

    shapes = [PlanShape("hpdc", 0.2, 0.1, None, (0.8, 0.4)), PlanShape("hpdc", 0.6, 0.3, None, (0.4, 0.0))]
    layout = ParallelLayout(3, 1, strategy="ditango", group_size=1)  # offsets 1, 2
    plan = replay(shapes, layout, 4, 30, 0.3)  # a quarter of the way from 0.2 to 0.6
    assert plan.selective_U == pytest.approx((0.7, 0.3)) and plan.anchors == round(0.15 * 20) and not plan.notes
    low = replay(shapes, layout, 4, 30, 0.1)
    assert low.selective_U == pytest.approx((0.8, 0.4)) and "priced with the shape at 0.2" in low.notes[0]
    assert replay(shapes, layout, 4, 30, 0.0).unit_fractions == [1.0, 1.0]  # cache ratio 0: exact
    assert _scale_to_mean([1.0, 0.5, 0.0], 0.8) == pytest.approx([1.0, 1.0, 0.4])  # what a full unit cannot take


def test_own_group_unit_maps_to_the_partner_not_to_offset_1():
    """Bug guarded: the mapping took unit u for ring offset u + 1, so a plan whose unit 0 is the
    own group's other members (unit_offsets [[0], [1]]) lent the partner's fraction to
    remote offset 1 of a bigger layout."""
    from planner.plan_shape import plan_shape, replay

    shape = plan_shape(OWN_PLAN, "hpdc", 0.5)
    assert (shape.own, shape.offsets, shape.anchor_share) == (0.5, (0.125,), 0.2)
    assert (shape.warmup, shape.cooldown) == (1, 0)  # its exact steps: one at the start, none at the end
    big = ParallelLayout(nodes=4, gpus_per_node=2, strategy="ditango", group_size=2)  # partner + offsets 1..3
    assert replay([shape], big, 2, 6, 0.5, warmup=1, cooldown=0).selective_U == (0.5, 0.125, 0.125, 0.125)
    fresh = replay([shape], big, 2, 6, 0.5, "fresh", warmup=1, cooldown=0)
    assert fresh.selective_U == (0.125, 0.125, 0.125)  # the partner is always computed


OWN_PLAN = {  # 2 layers, units [partner, offset 1]; selective: partner 4 of 8 cells, offset 1: 1 of 8
    "format": "ditango-plan-log/1", "unit_offsets": [[0], [1]], "expert_switches": [],
    "steps": [{"step": i, "kind": k, "epsilon": None, "compute": c} for i, (k, c) in enumerate([
        ("exact", ["11", "11"]), ("anchor", ["11", "11"]), ("selective", ["10", "10"]), ("selective", ["10", "00"]),
        ("selective", ["10", "01"]), ("selective", ["00", "00"])])],
}  # fmt: skip


def test_simulate_replays_a_plan_file(runner, tmp_path):
    from ditango_cli.app import app

    report = _write_run(tmp_path, OWN_PLAN, "hpdc", 0.5)
    args = ["simulate", "--nodes", "2", "--gpus-per-node", "8", "--group-size", "node", "--plan", str(report), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert "plan file's shape" in data["assumptions"]["ditango_plan"]
    assert data["assumptions"]["ditango_planner"] == "hpdc"
    assert (data["assumptions"]["ditango_warmup"], data["assumptions"]["ditango_cooldown"]) == (1, 0)  # the run's
    rows = {(r["strategy"], r["nodes"]): r for r in data["rows"]}
    assert rows["ditango", 1]["ditango"]["computed_fraction_selective"] == 0.5  # one group: the partner only
    assert rows["ditango", 2]["ditango"]["computed_fraction_selective"] == (0.5 + 0.125) / 2
    # offset 1 (the other node) computed on 1/8 of selective cells: far fewer inter-node bytes than the ring's
    assert rows["ditango", 2]["inter_node_bytes"] < rows["ring", 2]["inter_node_bytes"] / 2
    other = runner.invoke(app, [*args, "--planner", "budget"])
    assert other.exit_code == 2 and "used the hpdc planner" in other.stderr
    flat = _write_run(tmp_path, None, "hpdc", 0.5, per_step=(1.0, 0.0))  # no plan file: its mean for every unit
    data = json.loads(runner.invoke(app, [*args[:-2], str(flat), "--json"]).stdout)
    assert "no plan file" in data["assumptions"]["ditango_plan"]
    assert {r["ditango"]["computed_fraction_all_steps"] for r in data["rows"] if r["strategy"] == "ditango"} == {0.5}


def test_ditango_time_follows_each_offsets_slowest_rank():
    """Bug guarded: the time of remote offset d took rank 0's link to its source; where
    rank 0's fetch stays inside a node but another rank's crosses one, that rank is the
    slowest and sets the step. Ranks 0-2 on one node, rank 3 on another: at offset 1,
    0 -> 1 is intra-node while 2 -> 3 and 3 -> 0 cross, as on four separate nodes."""
    from planner.cost_model import Hardware, attention_time
    from planner.traffic import Topology

    hw = Hardware("slow-nic", bf16_tflops=1000.0, hbm_tbps=3.0, intra_gbps=400.0, inter_gbps=0.01, latency_us=1.0)
    layout = ParallelLayout(nodes=2, gpus_per_node=2, strategy="ditango", group_size=1)  # offsets 1, 2, 3
    tokens = SHAPE.tokens(SIZE)

    def offset_1(node_of: tuple[int, ...]) -> float:  # only offset 1 computed
        return attention_time(hw, Topology(layout, node_of), SHAPE, tokens, 2, [1.0, 0.0, 0.0])

    uneven, intra, inter = offset_1((0, 0, 0, 1)), offset_1((0, 0, 0, 0)), offset_1((0, 1, 2, 3))
    assert uneven == pytest.approx(inter, rel=1e-12)
    assert uneven > 10 * intra
