"""The layout search (planner/search.py) behind `--layout auto` and `simulate --batch`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from basics.errors import ConfigError
from ditango_cli.app import app
from planner.cost_model import load_hardware, with_overrides
from planner.layout import ParallelLayout, replica_shape
from planner.memory import MemoryOptions, cfg_branches, estimate_memory
from planner.models import VideoSize
from planner.preflight import fit_to_memory, usable_bytes
from planner.search import TIE, Problem, search
from runtime.models.registry import REGISTRY

GIB = 2**30


def assert_ranked(scores: list[float], inter: list[int]) -> None:
    """Best first: the leaders within TIE of the best score come first, fewest inter-node bytes
    first among them; the rest by score."""
    top = max(scores)
    tied = [i for i, x in enumerate(scores) if x >= top * (1 - TIE)]
    assert tied == list(range(len(tied))), "the tied leaders lead"
    assert [inter[i] for i in tied] == sorted(inter[i] for i in tied)
    rest = scores[len(tied) :]
    assert rest == sorted(rest, reverse=True)


@pytest.mark.parametrize(
    "model, nodes, gpus, memory_gib, reuse",
    [
        ("tiny-wan", 2, 4, 0, False),
        ("wan2.1-14b", 1, 8, 40, False),
        ("wan2.1-14b", 4, 8, 96, True),
        ("hunyuanvideo", 2, 8, 80, False),
        ("wan2.2-ti2v-5b", 3, 2, 24, True),
        ("wan2.2-t2v-a14b", 2, 8, 80, False),
    ],
)
def test_every_layout_returned_is_legal_and_fits(model, nodes, gpus, memory_gib, reuse):
    spec = REGISTRY[model]
    d = spec.defaults
    size = VideoSize(d.height, d.width, d.frames)
    p = Problem(
        spec.shape,
        size,
        d.steps,
        nodes,
        gpus,
        batch=5,
        cfg_scale=d.cfg_scale,
        allow_reuse=reuse,
        gpu_memory_bytes=memory_gib * GIB,
    )
    hw = load_hardware("h20")
    choices, notes = search(hw, p)
    assert choices
    seen_ditango = False
    for c in choices:
        lay = c.layout
        assert replica_shape(nodes, gpus, c.replicas) == (lay.nodes, lay.gpus_per_node)
        assert c.replicas * lay.world_size == nodes * gpus
        again = ParallelLayout(
            lay.nodes, lay.gpus_per_node, lay.cfg_degree, lay.strategy, lay.ulysses_degree, lay.group_size
        )
        again.check_model(spec.shape.heads, spec.shape.ffn, spec.shape.joint_text)  # raises when illegal
        assert lay.cfg_degree == 1 or d.cfg_scale > 1
        seen_ditango |= lay.strategy.reuses
        memory = (memory_gib * GIB) or hw.memory_bytes
        options = MemoryOptions(
            shard_weights=c.shard_weights,
            cfg_branches_per_rank=cfg_branches(d.cfg_scale, lay.cfg_degree),
            vae_parallel=lay.world_size > 1,
        )
        options = fit_to_memory(spec.shape, lay, size, options, memory)
        assert estimate_memory(spec.shape, lay, size, options).peak_bytes <= usable_bytes(memory), c.label
        assert c.peak_memory_bytes <= usable_bytes(memory)
    assert seen_ditango == reuse, "DiTango only when reuse is allowed"
    if model == "wan2.1-14b" and memory_gib == 40:  # 14B weights and its text encoder do not fit one 40 GiB GPU
        assert all(c.layout.world_size > 1 for c in choices) and any("do not fit" in n for n in notes)
        assert any(c.shard_weights for c in choices)


def test_a_batch_takes_replicas_and_one_video_a_single_replica():
    """The built-in model at 128x128 on 2 nodes x 4 GPUs, a batch of 64: throughput runs eight
    independent replicas (no link in any step), latency spreads one video over all eight."""
    spec = REGISTRY["tiny-wan"]
    d = spec.defaults
    common = dict(
        shape=spec.shape,
        size=VideoSize(128, 128, d.frames),
        steps=d.steps,
        nodes=2,
        gpus_per_node=4,
        batch=64,
        cfg_scale=d.cfg_scale,
    )
    hw = load_hardware("h20")
    best = search(hw, Problem(**common, objective="throughput"))[0][0]
    assert best.replicas == 8 and best.layout.world_size == 1 and best.inter_node_bytes == 0
    fastest = search(hw, Problem(**common, objective="latency"))[0][0]
    assert fastest.replicas == 1 and fastest.layout.world_size == 8
    ranked = search(hw, Problem(**common, objective="latency"))[0]
    assert_ranked([1 / c.e2e_s for c in ranked], [c.inter_node_bytes for c in ranked])


@pytest.mark.parametrize("hardware, height, width", [("h20", 720, 1280), ("h100", 480, 832)])
def test_a_slower_inter_node_link_moves_the_ranking_toward_fewer_bytes_between_nodes(hardware, height, width):
    """One video of Wan2.1-14B on 4 nodes x 8, latency: with the inter-node link 10x slower, the
    layouts that cross nodes more than most fall in the ranking, the others rise; every layout
    that crosses got slower and no other changed."""
    spec = REGISTRY["wan2.1-14b"]
    p = Problem(spec.shape, VideoSize(height, width, 81), 50, 4, 8, batch=1, objective="latency")
    hw = load_hardware(hardware)
    fast, _ = search(hw, p)
    slow, _ = search(with_overrides(hw, inter_gbps=hw.inter_gbps / 10), p)
    before, after = [c.label for c in fast], [c.label for c in slow]
    inter = {c.label: c.inter_node_bytes for c in fast}
    median = sorted(inter.values())[len(inter) // 2]
    heavy = [label for label in before if inter[label] > median]
    rest = [label for label in before if inter[label] <= median]
    moved = lambda labels: sum(after.index(x) - before.index(x) for x in labels) / len(labels)  # noqa: E731
    assert heavy and rest and moved(heavy) > 0 > moved(rest)
    assert slow[0].inter_node_bytes <= fast[0].inter_node_bytes
    if hardware == "h100":  # compute 6.7x faster than H20's: the link decides the leader
        assert slow[0].inter_node_bytes < fast[0].inter_node_bytes
    by_label = {c.label: c for c in fast}
    for c in slow:
        assert c.e2e_s > by_label[c.label].e2e_s if c.inter_node_bytes else c.e2e_s == by_label[c.label].e2e_s


def test_problem_and_overrides_refuse_bad_values():
    spec = REGISTRY["tiny-wan"]
    for kwargs, needle in ((dict(objective="speed"), "--objective must be one of"), (dict(batch=0), "--batch")):
        with pytest.raises(ConfigError, match=needle):
            Problem(spec.shape, VideoSize(64, 64, 17), 10, 1, 1, **kwargs)
    for kwargs, needle in ((dict(inter_gbps=0.0), "--inter-node-gbps"), (dict(overlap=1.5), "--overlap")):
        with pytest.raises(ConfigError, match=needle):
            with_overrides(load_hardware("h20"), **kwargs)


def test_simulate_ranks_layouts_as_json_and_as_a_table(runner):
    args = [
        "simulate",
        "--model",
        "tiny-wan",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--height",
        "128",
        "--width",
        "128",
        "--batch",
        "64",
    ]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    ranking = data["ranking"]
    assert data["objective"] == "throughput" and data["batch"] == 64 and ranking
    rates = [r["videos_per_hour"] for r in ranking]  # rounded in JSON: the tie's edge is left out
    assert rates[0] >= max(rates) * (1 - TIE - 1e-3)
    tail = [x for x in rates if x < max(rates) * (1 - TIE - 1e-3)]
    assert tail == sorted(tail, reverse=True) and rates[-len(tail) :] == tail
    for row in ranking:
        assert {"videos_per_hour", "e2e_s", "peak_memory_bytes", "layout", "flags", "inter_node_bytes"} <= set(row)
    assert ranking[0]["flags"] == ["--replicas", "8"]
    latency = json.loads(runner.invoke(app, [*args, "--objective", "latency", "--json"]).stdout)["ranking"]
    assert latency[0]["e2e_s"] <= min(r["e2e_s"] for r in latency) * (1 + TIE + 1e-3)
    table = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "why: 8 x [one GPU]" in table.stdout and "--replicas 8" in table.stdout


FAST = ["--prompt", "a red circle moving right", "--steps", "3", "--height", "32", "--width", "64", "--frames", "5",
        "--device", "cpu", "--quiet", "--save-latents", "--executor", "local", "--nodes", "2", "--gpus-per-node", "2"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.e2e
def test_layout_auto_runs_the_layout_it_names_and_makes_the_same_video_as_by_hand(runner, tmp_path):
    auto = tmp_path / "auto"
    result = runner.invoke(app, ["generate", *FAST, "--layout", "auto", "--out", str(auto)])
    assert result.exit_code == 0, result.stderr[-3000:]
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("layout auto")]
    report = json.loads((auto / "report.json").read_text())
    choice = report["layout_choice"]
    assert choice["objective"] == "throughput" and " ".join(choice["flags"]) in line
    assert report["layout"] == choice["layout"] and report["options"]["layout"] == "auto"
    by_hand = tmp_path / "by-hand"
    result = runner.invoke(app, ["generate", *FAST, *choice["flags"], "--out", str(by_hand)])
    assert result.exit_code == 0, result.stderr[-3000:]
    assert json.loads((by_hand / "report.json").read_text())["layout"] == report["layout"]
    (item,) = report["items"]
    ours = load_file(str(auto / f"{item['id']}.latents.safetensors"))["latents"]
    theirs = load_file(str(by_hand / f"{item['id']}.latents.safetensors"))["latents"]
    assert torch.equal(ours, theirs)


def test_layout_auto_refuses_the_options_it_chooses(runner, tmp_path):
    for extra, flag in (
        (["--parallel", "ring"], "--parallel"),
        (["--cfg-parallel"], "--cfg-parallel"),
        (["--replicas", "2"], "--replicas"),
    ):
        check = [a for a in FAST if a not in ("--quiet", "--save-latents")]
        result = runner.invoke(app, ["check", *check, "--layout", "auto", *extra, "--out", str(tmp_path / "o")])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and f"--layout auto chooses {flag}" in lines[0], result.stderr
    result = runner.invoke(
        app, ["generate", *FAST, "--layout", "auto", "--dry-run", "--json", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["layout_choice"]["layout"] == record["layout"] and not (tmp_path / "o").exists()


def test_several_gpus_and_no_strategy_named_take_the_best_exact_layout(runner, tmp_path):
    """The issue's plan: 50 videos of wan2.1-14b on 4 x 8 GPUs, no strategy named: the search's
    best exact layout (the one --layout auto picks, not ring over 32 ranks), said in one line and
    recorded; --parallel ring keeps ring (tests/test_launchers.py: a launcher's ranks default to it)."""
    batch = tmp_path / "batch.txt"
    batch.write_text("".join(f"a red fox number {k} runs through the snow\n" for k in range(50)))
    base = ["generate", "--model", "wan2.1-14b", "--nodes", "4", "--gpus-per-node", "8", "--prompts", str(batch)]
    base += ["--dry-run", "--json", "--executor", "local", "--device", "cpu"]

    def dry(*extra: str) -> tuple[dict, str]:
        result = runner.invoke(app, [*base, *extra, "--out", str(tmp_path / "o")])
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout), result.stderr

    record, said = dry()
    auto, _ = dry("--layout", "auto")
    choice = record["layout_choice"]
    assert choice["by_default"] and not auto["layout_choice"]["by_default"] and not choice["allow_reuse"]
    assert (record["layout"], choice["flags"]) == (auto["layout"], auto["layout_choice"]["flags"])
    assert record["layout"]["strategy"] != "ditango" and choice["flags"] != ["--parallel", "ring"]
    (line,) = [ln for ln in said.splitlines() if ln.startswith("layout (no --parallel given")]
    assert "the search's best exact one" in line and " ".join(choice["flags"]) in line
    ring, said = dry("--parallel", "ring")
    assert ring["layout_choice"] is None and "layout (" not in said
    assert (ring["layout"]["strategy"], ring["layout"]["cp_degree"]) == ("ring", 32)
    assert not (tmp_path / "o").exists()


def test_a_measured_profile_is_calibrated_and_overlap_prices_hidden_transfers(tmp_path):
    from planner.cost_model import Hardware, estimate

    spec = REGISTRY["wan2.1-14b"]
    size, layout = VideoSize(480, 832, 81), ParallelLayout(2, 8, 1, "ring")
    profile = {
        "name": "measured",
        "bf16_tflops": 700.0,
        "hbm_tbps": 4.0,
        "intra_gbps": 450.0,
        "inter_gbps": 50.0,
        "latency_us": 10.0,
        "measured": {"best_attention_over_matmul": 0.6},
    }
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(profile))
    hw = load_hardware(str(path))
    assert (hw.matmul_efficiency, hw.attention_efficiency) == (1.0, 0.6)  # its TFLOPS are achieved ones
    plain = load_hardware("h20")
    assert (plain.matmul_efficiency, plain.attention_efficiency) == (0.7, 0.5)
    uncalibrated = Hardware(**{k: v for k, v in profile.items() if k != "measured"})
    one = ParallelLayout(1, 1)
    # One GPU is all compute: calibrated, it runs at 700 x (1, 0.6) where the datasheet model says 700 x (0.7, 0.5).
    assert estimate(hw, one, spec.shape, size, 1).e2e_s < estimate(uncalibrated, one, spec.shape, size, 1).e2e_s
    hidden = estimate(plain, layout, spec.shape, size, 50).e2e_s
    serial = estimate(with_overrides(plain, overlap=0.0), layout, spec.shape, size, 50).e2e_s
    assert serial > hidden  # the ring's transfers now add to its compute
    profile["measured"]["best_attention_over_matmul"] = 0
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match="attention_efficiency must be above 0"):
        load_hardware(str(path))


def test_a_video_shorter_than_the_ranks_is_not_split_over_all_of_them():
    spec = REGISTRY["tiny-wan"]
    size = VideoSize(32, 32, 1)  # 16 tokens
    assert spec.shape.tokens(size) == 16
    choices, _ = search(load_hardware("h20"), Problem(spec.shape, size, 4, 4, 8, batch=3, allow_reuse=True))
    assert choices and all(c.layout.cp_degree <= 16 for c in choices)
    assert any(c.layout.cp_degree == 16 for c in choices)
