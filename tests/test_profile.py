"""--profile: a trace per rank and item, and each rank's time by category, summing to the wall time."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.nn.functional as F

from runtime.profiling import CATEGORIES, StepProfiler, category_of, region, step_region, summary
from tests.cli_runs import TWO_SMALL_RANKS, generate


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with region("attention"):
        x = x @ w  # a matmul inside the attention region is attention, not linear
    x = F.linear(x, w)
    x = F.layer_norm(x, x.shape[-1:])
    with region("merge"):
        x = x * 0.5 + 1.0
    x = x.to(torch.float64).float()
    return F.gelu(x)


def test_every_op_is_in_one_category_and_the_first_step_is_left_out(tmp_path):
    trace = tmp_path / "profile" / "item.rank0.json.gz"
    profiler = StepProfiler(torch.device("cpu"), 3, trace)
    on_step = profiler.observing(lambda done, steps: None)
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    for step in range(3):
        with step_region(step):
            x = _step(x, w)
        on_step(step + 1, 3)
    table = profiler.finish(3)
    cpu = table["cpu_ms"]
    assert table["steps"] == 2 and set(cpu) == set(CATEGORIES) and "device_ms" not in table
    for category in ("attention", "linear", "norms", "merge", "copies", "other ops", "outside ops"):
        assert cpu[category] > 0, category
    assert cpu["exchange"] == cpu["rotary"] == cpu["bookkeeping"] == 0
    assert sum(cpu.values()) == pytest.approx(table["wall_ms"], abs=0.01)  # own times partition the window
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "ditango::step 1" in names and "ditango::step 2" in names and "ditango::step 0" not in names


def test_an_unprofiled_run_has_no_regions():
    assert not torch.autograd._profiler_enabled()
    with region("merge") as span, step_region(3) as marker:
        assert span is None and marker is None  # nullcontext: no profiler work at all


def test_categories_follow_the_nearest_region_then_the_outermost_op():
    class E:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    span = E("ditango::profiled")
    step = E("ditango::step 4", span)
    linear = E("aten::linear", step)
    assert category_of(E("aten::addmm", linear)) == "linear"
    assert category_of(E("aten::copy_", E("aten::to", step))) == "copies"
    assert category_of(E("aten::copy_", E("aten::_to_copy", E("ditango::attention", step)))) == "attention"
    assert category_of(E("aten::mul", E("ditango::bookkeeping", E("ditango::merge", step)))) == "bookkeeping"
    assert category_of(E("gloo:send", step)) == "exchange" and category_of(E("aten::gelu", step)) == "other ops"
    assert category_of(step) == "outside ops" and category_of(E("aten::topk", step)) == "other ops"


def test_the_reports_table_weights_items_by_their_profiled_steps():
    def row(steps, wall, attention):
        return {"steps": steps, "wall_ms": wall, "cpu_ms": {"attention": attention, "outside ops": wall - attention}}

    records = [
        {"profile": {"per_rank": [row(1, 10.0, 4.0), row(1, 10.0, 6.0)]}},
        {"profile": None},
        {"profile": {"per_rank": [row(3, 20.0, 8.0), row(3, 20.0, 10.0)]}},
    ]
    got = summary(records)
    assert got["items"] == 2 and [r["steps"] for r in got["per_rank"]] == [4, 4]
    assert got["per_rank"][0]["wall_ms"] == 17.5 and got["per_rank"][0]["cpu_ms"]["attention"] == 7.0
    assert got["per_rank"][1]["cpu_ms"]["attention"] == 9.0
    assert summary([{"profile": None}]) is None


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_profiled_ring_run_reports_every_rank(tmp_path):
    out = tmp_path / "out"
    report, _ = generate(out, *TWO_SMALL_RANKS, "--parallel", "ring", "--steps", "3", "--profile")
    item = report["items"][0]
    assert len(item["profile"]["per_rank"]) == 2 and report["profile"]["items"] == 1
    for rank, (table, trace) in enumerate(zip(item["profile"]["per_rank"], item["profile"]["traces"], strict=True)):
        cpu = table["cpu_ms"]
        assert table["steps"] == 2 and trace == f"profile/{item['id']}.rank{rank}.json.gz"
        for category in ("attention", "merge", "exchange", "rotary", "linear", "norms"):
            assert cpu[category] > 0, (rank, category)
        assert cpu["bookkeeping"] == 0  # the ring keeps no cache
        assert sum(cpu.values()) == pytest.approx(table["wall_ms"], abs=0.01)
        names = {e.get("name") for e in json.loads(gzip.open(out / trace).read())["traceEvents"]}
        assert "ditango::exchange" in names and "ditango::merge" in names
