"""A batch's schedule priced (planner/batch.py), the layout search over a batch of mixed items
(planner/search.py `mix`, `workers`, `queue`), and `simulate --batch FILE`."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace

import pytest

from ditango_cli.app import app
from planner.batch import ideal_makespan, longest_first, lpt_makespan, round_robin_makespan
from planner.cost_model import load_hardware
from planner.layout import ParallelLayout
from planner.models import VideoSize
from planner.search import TIE, Problem, item_seconds, search
from runtime.models.registry import REGISTRY
from tests.conftest import refused

EPS = 1e-9  # float sums in a different order


def optimum(seconds: list[float], workers: int) -> float:
    """The best makespan, by trying every assignment of items to workers."""
    best = math.inf
    for owners in itertools.product(range(workers), repeat=len(seconds)):
        loads = [0.0] * workers
        for s, w in zip(seconds, owners, strict=True):
            loads[w] += s
        best = min(best, max(loads))
    return best if seconds else 0.0


def test_lpt_is_within_grahams_bound_of_the_optimum_on_random_batches():
    rng = random.Random(20240611)
    worse = 0
    for _ in range(300):
        workers = rng.randint(1, 3)
        seconds = [rng.choice((1.0, 2.0, 3.0, rng.uniform(0.1, 10.0))) for _ in range(rng.randint(0, 7))]
        best, lpt = optimum(seconds, workers), lpt_makespan(seconds, workers)
        assert ideal_makespan(seconds, workers) <= best + EPS
        assert best - EPS <= lpt <= (4 / 3 - 1 / (3 * workers)) * best + EPS, (seconds, workers)
        assert lpt >= ideal_makespan(seconds, workers) - EPS
        rr = round_robin_makespan(seconds, workers)
        assert rr >= best - EPS and rr >= ideal_makespan(seconds, workers) - EPS
        worse += lpt > best + EPS
    assert worse, "some instance where LPT is not optimal: the brute force is not LPT itself"


def test_lpt_is_the_list_schedule_not_the_optimum():
    """Graham's tight case on 2 workers: 3, 3 go one each, the three 2s make 5, 5, then 7; the
    optimum is 3+3 | 2+2+2 = 6 (7/6 = 4/3 - 1/(3x2))."""
    assert lpt_makespan([2.0, 3.0, 2.0, 3.0, 2.0], 2) == 7.0
    assert optimum([2.0, 3.0, 2.0, 3.0, 2.0], 2) == 6.0


def test_round_robin_pays_an_unbalanced_order_that_the_queue_does_not():
    """12 items, the 4-unit ones at positions 0, 4, 8 and 11, over 4 workers: round robin gives
    worker 0 positions 0, 4, 8 (4+4+4 = 12); longest first gives each worker one 4 and two 1s
    (4+1+1 = 6), the ideal 24/4."""
    seconds = [4.0 if i in (0, 4, 8, 11) else 1.0 for i in range(12)]
    assert round_robin_makespan(seconds, 4) == 12.0
    assert lpt_makespan(seconds, 4) == 6.0 == ideal_makespan(seconds, 4)


def test_edges_and_order():
    for fn in (lpt_makespan, round_robin_makespan, ideal_makespan):
        assert fn([], 3) == 0.0
        assert fn([5.0], 4) == 5.0  # one item: one worker takes it, the others idle
        with pytest.raises(ValueError, match="workers must be >= 1"):
            fn([1.0], 0)
        with pytest.raises(ValueError, match="finite and >= 0"):
            fn([1.0, -2.0], 1)
    assert lpt_makespan([1.0, 2.0, 3.0], 1) == round_robin_makespan([1.0, 2.0, 3.0], 1) == 6.0
    prices = {"a": 1.0, "b": 5.0, "c": 1.0, "d": 5.0, "e": 2.0}
    assert longest_first(prices) == ["b", "d", "e", "a", "c"]  # ties in the mapping's order
    assert longest_first({}) == []


SMALL, LARGE = VideoSize(480, 832, 17), VideoSize(480, 832, 81)


def wan(**kwargs) -> Problem:
    spec = REGISTRY["wan2.1-1.3b"]
    d = spec.defaults
    base = dict(shape=spec.shape, size=LARGE, steps=d.steps, nodes=1, gpus_per_node=4, cfg_scale=d.cfg_scale)
    return Problem(**{**base, **kwargs})


def test_a_mix_of_one_long_and_many_short_items_is_scheduled_as_the_queue_runs_it():
    """One 81-frame video and seven 17-frame ones on 1 x 4 H20s. Eight copies of the long one
    favour four independent GPUs (no link, and 8 = 2 rounds of 4); the real mix does not: four
    single GPUs cannot finish before the long video does on one GPU, while a layout over all
    four GPUs finishes it in about a quarter of that."""
    hw = load_hardware("h20")
    d = REGISTRY["wan2.1-1.3b"].defaults
    mix = ((LARGE, d.steps, d.cfg_scale),) + ((SMALL, d.steps, d.cfg_scale),) * 6 + ((SMALL, 20, d.cfg_scale),)
    copies, _ = search(hw, wan(batch=8))
    mixed, _ = search(hw, wan(mix=mix))
    assert copies[0].replicas == 4 and copies[0].layout.world_size == 1
    assert mixed[0].replicas == 1 and mixed[0].layout.world_size == 4
    singles = next(c for c in mixed if c.replicas == 4)
    one_gpu = item_seconds(hw, wan(batch=1), singles.layout)
    assert singles.batch_s >= one_gpu and singles.videos_per_hour < mixed[0].videos_per_hour * (1 - TIE)
    for c in mixed:  # every choice's batch is the queue's schedule of its items, priced one by one
        each = [
            item_seconds(hw, wan(size=size, steps=steps, cfg_scale=cfg), c.layout, c.shard_weights)
            for size, steps, cfg in mix
        ]
        assert c.e2e_s == pytest.approx(each[0], rel=1e-12)  # the problem's own item: the choice's price
        assert c.batch_s == lpt_makespan(each, c.replicas)
        assert c.round_robin_s == round_robin_makespan(each, c.replicas)
        assert c.videos_per_hour == pytest.approx(len(mix) / c.batch_s * 3600, rel=1e-12)
    assert singles.round_robin_s > singles.batch_s  # round robin: worker 0 takes the long one and item 4


def test_workers_share_the_queue_and_the_static_split_keeps_its_rounds():
    """Two array tasks of the allocation pull from one queue: LPT over replicas x 2. Static: each
    task takes 4 of the 8 items and runs them in rounds of its largest."""
    hw = load_hardware("h20")
    d = REGISTRY["wan2.1-1.3b"].defaults
    mix = ((LARGE, d.steps, d.cfg_scale),) * 3 + ((SMALL, d.steps, d.cfg_scale),) * 5
    shared, _ = search(hw, wan(mix=mix, workers=2))
    static, _ = search(hw, wan(mix=mix, workers=2, queue="static"))
    by_label = {c.label: c for c in static}
    for c in shared:
        each = [item_seconds(hw, wan(size=s, steps=n, cfg_scale=g), c.layout, c.shard_weights) for s, n, g in mix]
        assert c.batch_s == lpt_makespan(each, 2 * c.replicas)
        rounds = math.ceil(4 / c.replicas)  # 8 items over 2 tasks: 4 each
        assert by_label[c.label].batch_s == rounds * c.e2e_s
    assert "longest first over" in _why(shared, mix, 2) and "in each of 2 array tasks" in _why(shared, mix, 2)
    assert "round(s) of" in _why(static, mix, 2, "static")


def _why(choices, mix, workers, queue="shared") -> str:
    from planner.search import why

    return why(choices, wan(mix=mix, workers=workers, queue=queue))


def test_every_layout_takes_every_item_of_the_mix():
    """runtime/config.py refuses a run whose layout some item cannot take: no cfg-parallel when
    an item has one CFG branch, no more context-parallel ranks than the smallest item's tokens."""
    hw = load_hardware("h20")
    spec = REGISTRY["tiny-wan"]
    tiny = VideoSize(32, 32, 1)  # 16 tokens
    assert spec.shape.tokens(tiny) == 16
    own = (VideoSize(128, 128, 17), 4, 5.0)
    for mix, ok in (
        ((own, (own[0], 4, 1.0)), lambda lay: lay.cfg_degree == 1),
        ((own, (tiny, 4, 5.0)), lambda lay: lay.cp_degree <= 16),
    ):
        p = Problem(spec.shape, own[0], 4, 4, 8, cfg_scale=5.0, mix=mix)
        choices, _ = search(hw, p)
        assert choices and all(ok(c.layout) for c in choices)
        alone, _ = search(hw, replace(p, mix=()))
        assert not all(ok(c.layout) for c in alone), "the item's own layouts include the refused ones"


def test_a_problem_refuses_a_bad_queue_or_count():
    spec = REGISTRY["tiny-wan"]
    size = VideoSize(64, 64, 17)
    for kwargs, needle in (
        (dict(queue="fifo"), "--queue must be one of shared, static"),
        (dict(workers=0), "must be >= 1, got 0"),
        (dict(batch=3, mix=((size, 4, 5.0),) * 2), "a batch of 3 with 2 items"),
    ):
        with pytest.raises(ValueError, match=needle):
            Problem(spec.shape, size, 4, 1, 1, **kwargs)
    assert item_seconds(load_hardware("h20"), Problem(spec.shape, size, 4, 1, 1), ParallelLayout(1, 1)) > 0


SIMULATE = ["simulate", "--model", "tiny-wan", "--nodes", "2", "--gpus-per-node", "4", "--height", "128"]


def test_simulate_prices_a_prompt_files_items(runner, tmp_path):
    """Lines that leave the size out take the command line's, else the model's, as generate
    resolves them: four such lines are `--batch 4`; a file of mixed items shows both schedules."""
    d = REGISTRY["tiny-wan"].defaults
    same = tmp_path / "same.txt"
    same.write_text("# four prompts\na\nb\n\nc\nd\n")
    from_file = runner.invoke(app, [*SIMULATE, "--batch", str(same), "--json"])
    assert from_file.exit_code == 0, from_file.stderr
    counted = runner.invoke(app, [*SIMULATE, "--batch", "4", "--json"])
    assert counted.exit_code == 0, counted.stderr
    a, b = json.loads(from_file.stdout), json.loads(counted.stdout)
    assert a["batch"] == b["batch"] == 4 and a["mix"] == [
        {"height": 128, "width": d.width, "frames": d.frames, "steps": d.steps, "guidance": d.cfg_scale, "videos": 4}
    ]
    rates = lambda data: {r["label"]: r["videos_per_hour"] for r in data["ranking"]}  # noqa: E731
    assert rates(a) == rates(b)
    mixed = tmp_path / "mixed.jsonl"
    lines = [{"prompt": "long", "frames": 81}] + [{"prompt": f"short {i}", "frames": 5, "steps": 10} for i in range(9)]
    mixed.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = runner.invoke(app, [*SIMULATE, "--batch", str(mixed), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["batch"] == 10 and [m["videos"] for m in data["mix"]] == [1, 9]
    assert (data["assumptions"]["frames"], data["assumptions"]["steps"]) == (81, d.steps)  # the largest item
    for row in data["ranking"]:
        assert row["videos_per_hour"] == pytest.approx(10 / row["batch_s"] * 3600, rel=1e-3)
        # LPT is optimal here: the long item alone, then identical short ones, each to the least loaded worker
        assert row["batch_s"] <= row["round_robin_s"] + 1e-3
    table = runner.invoke(app, [*SIMULATE, "--batch", str(mixed)], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.stderr
    assert "round robin (s)" in table.stdout and "10 video(s) from" in table.stdout
    assert "longest first over" in table.stdout


def test_simulate_refuses_a_bad_batch_in_one_line(runner, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "too wide", "width": 100}\n')
    refused(runner.invoke(app, [*SIMULATE, "--batch", str(bad)]), "bad.jsonl line 2: width must be")
    refused(runner.invoke(app, [*SIMULATE, "--batch", str(tmp_path / "none.jsonl")]), "no such file")
    refused(runner.invoke(app, [*SIMULATE, "--batch", "-3"]), "--batch -3: give a number of videos")
    refused(runner.invoke(app, [*SIMULATE, "--batch", "0"]), "--batch must be >= 1, got 0")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    refused(runner.invoke(app, [*SIMULATE, "--batch", str(empty)]), f"--batch {empty}: no prompts in the file")
    other = tmp_path / "prompts.csv"
    other.write_text("a\n")
    refused(runner.invoke(app, [*SIMULATE, "--batch", str(other)]), "--batch", "expected a .txt or .jsonl file")
