"""Whole-pipeline parity of the exact strategies (gloo, 2-4 processes) and CLI multi-rank runs."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from ditango_cli.app import app
from planner.layout import ParallelLayout, chunk_sizes, virtual_node_map
from runtime.assembly import build_denoiser
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.mesh import build_mesh
from runtime.models.loading import resolve_placement
from slurm.launchers.processes import run_ranks
from tests.conftest import FAST_ARGV
from tiny_wan import TinyWanConfig, build_tiny_wan

LATENT_ATOL = 1e-4  # the bound: merge order changes rounding, nothing else may
TIMEOUT_S = 90
# 12 heads so Ulysses 2, 3, 4 and USP 2x2 are all legal; tiny otherwise.
CP_MODEL = TinyWanConfig(seed=21, heads=12, head_dim=8, layers=2, ffn_dim=48, text_dim=24, text_heads=2)
GEN = dict(prompt="a yellow circle moving down", negative="blurry", seed=5, steps=3, guidance=4.0)
SIZE = dict(height=48, width=80, frames=5)  # latent 2 x 6 x 10 -> 2 * 3 * 5 = 30 tokens (uneven over 4)
TEXT_LEN = 16


def denoise(denoiser: Denoiser) -> torch.Tensor:
    text = denoiser.encode_text(GEN["prompt"], GEN["negative"], GEN["guidance"])
    x = denoiser.initial_latents(GEN["seed"], SIZE["height"], SIZE["width"], SIZE["frames"])
    return denoiser.denoise(x, text, GEN["steps"], GEN["guidance"]).latents_BCFHW


def _pipeline_target(rank, world, events, strategies, nodes):
    components = build_tiny_wan(CP_MODEL)
    out = {}
    for strategy, ulysses in strategies:
        layout = ParallelLayout(nodes=nodes, gpus_per_node=world // nodes, strategy=strategy, ulysses_degree=ulysses)
        mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
        comm = Comm(mesh)
        denoiser = build_denoiser(components, resolve_placement("cpu"), TEXT_LEN, mesh=mesh, comm=comm)
        latents = denoise(denoiser)
        denoiser.parallel.remove()
        out[strategy] = (latents, comm.totals())
    return out


@pytest.fixture(scope="module")
def reference():
    return denoise(Denoiser(build_tiny_wan(CP_MODEL), resolve_placement("cpu"), TEXT_LEN))


@pytest.mark.parametrize(
    "world,nodes,strategies",
    [
        (2, 1, [("ring", None), ("ulysses", None)]),
        (3, 1, [("ring", None), ("ulysses", None)]),
        (4, 2, [("ring", None), ("ulysses", None), ("usp", 2)]),
    ],
)
@pytest.mark.distributed
def test_pipeline_latents_equal_single_process(reference, world, nodes, strategies):
    per_rank = run_ranks(_pipeline_target, world, (strategies, nodes), timeout_s=TIMEOUT_S)
    tokens = 30
    sizes = chunk_sizes(tokens, world)
    forwards = GEN["steps"] * 2  # two CFG branches per step
    for parallel, _ in strategies:
        for rank in range(world):
            latents, totals = per_rank[rank][parallel]
            err = (latents - reference).abs().max().item()
            assert err <= LATENT_ATOL, (parallel, rank, err)
            # Every rank steps its own scheduler on the gathered prediction: identical latents.
            assert torch.equal(latents, per_rank[0][parallel][0])
            if parallel == "ring":
                # Per self-attention layer per forward: K and V of the other P-1 chunks.
                kv = sum(2 * n * CP_MODEL.heads * CP_MODEL.head_dim * 4 for j, n in enumerate(sizes) if j != rank)
                got = totals["by_purpose"]["attention"]
                assert sum(got.values()) == kv * CP_MODEL.layers * forwards
        inter = sum(per_rank[r][parallel][1]["inter_node_bytes"] for r in range(world))
        assert (inter > 0) == (nodes > 1)
    assert (reference - torch.randn(reference.shape, generator=torch.Generator().manual_seed(5))).abs().max() > 1e-2


FAST = FAST_ARGV


@pytest.mark.distributed
@pytest.mark.e2e
def test_cli_two_ranks_two_virtual_nodes_matches_one_process(runner, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    base = ["generate", "--prompt", "a green square moving left", "--save-latents", *FAST]
    assert runner.invoke(app, [*base, "--out", str(one)]).exit_code == 0
    result = runner.invoke(
        app, [*base, "--out", str(two), "--gpus", "1", "--nodes", "2", "--parallel", "ring", "--executor", "local"]
    )
    assert result.exit_code == 0, result.stderr
    a = load_file(next(one.glob("*.latents.safetensors")))["latents"]
    b = load_file(next(two.glob("*.latents.safetensors")))["latents"]
    assert (a - b).abs().max().item() <= LATENT_ATOL
    report = json.loads((two / "report.json").read_text())
    assert report["layout"]["world_size"] == 2 and report["layout"]["nodes"] == 2
    assert report["layout"]["strategy"] == "ring" and report["attention_backend"] == "sdpa"
    assert len(report["per_rank_peak_memory_bytes"]) == 2
    comm = report["items"][0]["comm"]
    assert comm["inter_node_bytes"] > 0 and comm["intra_node_bytes"] == 0
    assert sorted(p.name for p in (two / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]


@pytest.mark.distributed
@pytest.mark.e2e
def test_failing_item_is_retried_then_given_up_while_the_batch_goes_on(runner, tmp_path, monkeypatch):
    """A rank that raises inside item b ends that launch at once (not after the 300 s group
    timeout); b is retried in a fresh launch, then given up, and a and c are still generated."""
    prompts = tmp_path / "batch.jsonl"
    lines = [
        json.dumps({"id": i, "prompt": f"a {c} ball"}) for i, c in zip("abc", ("red", "green", "blue"), strict=True)
    ]
    prompts.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "1:2:b")
    out = tmp_path / "out"
    args = ["generate", "--prompts", str(prompts), "--out", str(out), "--gpus", "2", "--timeout", "300", *FAST]
    start = time.monotonic()
    result = runner.invoke(app, [*args, "--retries", "1"])
    elapsed = time.monotonic() - start
    assert result.exit_code == 1
    assert elapsed < 120  # three launches, each ended by the supervisor, not by the group timeout
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 item(s) failed: b")
    assert sorted(p.stem for p in out.glob("*.mp4")) == ["a", "c"]
    report = json.loads((out / "report.json").read_text())
    assert report["counts"] == {"done": 2, "skipped": 0, "failed": 1}
    (b,) = [r for r in report["items"] if r["id"] == "b"]
    assert b["attempts"] == 2 and "injected fault on rank 1 after step 2" in b["error"] and "rank-1.log" in b["error"]

    # A transient failure: fires once, so the retry succeeds; a and c are not redone.
    mtimes = {n: (out / f"{n}.mp4").stat().st_mtime_ns for n in "ac"}
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(tmp_path / "fired"))
    result = runner.invoke(app, [*args, "--retries", "1"])
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "fired").exists() and (out / "b.mp4").is_file()
    assert {n: (out / f"{n}.mp4").stat().st_mtime_ns for n in "ac"} == mtimes
    report = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in report["items"]] == ["skipped", "done", "skipped"]
    assert json.loads((out / "b.json").read_text())["status"] == "done"


STEP_TIMEOUT_S = 10
FAULT_MARGIN_S = 15  # detection, stopping the ranks, blame and report, on a loaded CI machine


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["raise", "hang", "exit"])
@pytest.mark.e2e
def test_a_failing_rank_ends_the_local_run_within_the_step_timeout(runner, tmp_path, monkeypatch, kind):
    """A rank that raises, stops answering (a wedged GPU) or dies without a word (killed, out
    of memory) ends the whole launch within the per-step timeout plus a margin, with the error
    of the rank at fault on the item; nothing waits for the setup timeout (30 minutes) or forever."""
    fired = tmp_path / "fired"
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "1:2")
    monkeypatch.setenv("DITANGO_FAULT_KIND", kind)
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(fired))  # its mtime says when the fault fired
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompt",
        "a red ball",
        "--out",
        str(out),
        "--gpus",
        "2",
        "--parallel",
        "ring",
        "--retries",
        "0",
        "--timeout",
        str(STEP_TIMEOUT_S),
        *FAST,
        "--steps",
        "6",
    ]
    result = runner.invoke(app, args)
    elapsed = time.time() - fired.stat().st_mtime
    assert result.exit_code == 1, result.stderr
    assert elapsed <= STEP_TIMEOUT_S + FAULT_MARGIN_S, elapsed
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["status"] == "failed"
    if kind == "raise":
        assert "rank 1 failed: RuntimeError: injected fault on rank 1 after step 2" in item["error"]
    elif kind == "exit":  # its peer saw the connection drop; the dead rank is the one blamed
        assert "rank 1 failed: process exited with code 3 without an error" in item["error"]
    else:  # the peer of the silent rank timed out in its collective
        assert "rank 0 failed" in item["error"] and "Timed out" in item["error"]


@pytest.mark.distributed
def test_replicas_split_the_items_and_match_one_process(runner, tmp_path):
    """--replicas 2 on 2 ranks: two independent single-rank replicas share the items (from the
    folder's queue: each item made by one of them; --queue static: round-robin), each writes its
    own report, and every video equals the one-process run."""
    prompts = tmp_path / "batch.txt"
    prompts.write_text("a red ball\na green ball\na blue ball\n")
    base = ["generate", "--prompts", str(prompts), "--save-latents", "--executor", "local", *FAST]
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "one")]).exit_code == 0
    everything = sorted(p.stem for p in (tmp_path / "one").glob("*.mp4"))
    for queue in ("shared", "static"):
        out = tmp_path / queue
        result = runner.invoke(app, [*base, "--out", str(out), "--gpus", "2", "--replicas", "2", "--queue", queue])
        assert result.exit_code == 0, result.stderr
        shares = [json.loads((out / ".ditango" / "reports" / f"replica-{r}.json").read_text()) for r in (0, 1)]
        ids = [[i["id"] for i in share["items"]] for share in shares]
        if queue == "static":
            assert ids == [everything[0::2], everything[1::2]]
        assert sorted(ids[0] + ids[1]) == everything, result.stderr  # each item made once
        assert all(share["layout"]["world_size"] == 1 for share in shares)
        report = json.loads((out / "report.json").read_text())
        assert report["counts"] == {"done": 3, "skipped": 0, "failed": 0}
        for stem in everything:
            a = load_file(tmp_path / "one" / f"{stem}.latents.safetensors")["latents"]
            b = load_file(out / f"{stem}.latents.safetensors")["latents"]
            assert torch.equal(a, b), (queue, stem)


def test_replicas_must_fit_the_allocation(runner, tmp_path):
    args = ["generate", "--prompt", "x", "--out", str(tmp_path), "--nodes", "2", "--gpus", "3", "--replicas", "4"]
    result = runner.invoke(app, [*args, "--executor", "local"])
    assert result.exit_code == 2
    assert "--replicas 4 must divide the 2 nodes, or split each node's 3 ranks evenly" in result.stderr


def four_items(tmp_path):
    prompts = tmp_path / "batch.jsonl"
    lines = [
        json.dumps({"id": i, "prompt": f"a {c} ball"})
        for i, c in zip("abcd", ("red", "green", "blue", "white"), strict=True)
    ]
    prompts.write_text("\n".join(lines) + "\n")
    return ["generate", "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--gpus", "4", "--replicas", "2"]


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_failing_replica_charges_only_its_own_item(runner, tmp_path, monkeypatch):
    """--queue static, 2 replicas x 2 ranks: rank 3 (replica 1) raises inside item d. Every rank
    is stopped, including replica 0 in the middle of its own item; only d is charged, and the
    item replica 0 was running is simply run again."""
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "3:2:d")  # replica 1 takes b and d
    args = [*four_items(tmp_path), "--parallel", "ring", "--executor", "local", "--retries", "0", "--queue", "static"]
    result = runner.invoke(app, [*args, *FAST])
    out = tmp_path / "out"
    assert result.exit_code == 1
    assert "first: rank 3 failed: RuntimeError: injected fault on rank 3 after step 2" in result.stderr
    report = json.loads((out / "report.json").read_text())
    status = {r["id"]: r["status"] for r in report["items"]}
    assert status == {"a": "done", "b": "done", "c": "done", "d": "failed"}
    for name in "abc":
        assert "attempts" not in json.loads((out / f"{name}.json").read_text())
    assert json.loads((out / "d.json").read_text())["attempts"] == 1


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_failing_replica_ends_alone_under_the_queue(runner, tmp_path, monkeypatch):
    """The shared queue, 2 replicas x 2 ranks: rank 3 (replica 1) raises in its first item. Only
    replica 1 stops: its item is charged (no retry: given up), replica 0 makes the other three,
    and the run says which worker was lost."""
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "3:2")
    args = [*four_items(tmp_path), "--parallel", "ring", "--executor", "local", "--retries", "0"]
    result = runner.invoke(app, [*args, *[a for a in FAST if a != "--quiet"]])
    out = tmp_path / "out"
    assert result.exit_code == 1, result.stderr
    assert "replica 1 failed: rank 3 failed: RuntimeError: injected fault on rank 3 after step 2" in result.stderr
    assert "note: replica 1 was lost" in result.stderr
    report = json.loads((out / "report.json").read_text())
    failed = [r for r in report["items"] if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["attempts"] == 1 and "injected fault" in failed[0]["error"]
    done = [r for r in report["items"] if r["status"] == "done"]
    assert len(done) == 3 and all("replica-0" in r["queue"]["label"] for r in done)


def test_single_process_retries_an_item_in_process(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("DITANGO_FAULT_INJECT", "0:1:b")
    monkeypatch.setenv("DITANGO_FAULT_ONCE", str(tmp_path / "fired"))
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"a {i} ball"}) + "\n" for i in "ab"))
    out = tmp_path / "out"
    args = [
        "generate",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--retries",
        "1",
        *[a for a in FAST if a != "--quiet"],
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert "b failed (RuntimeError: injected fault on rank 0 after step 1" in result.stderr
    assert "retry 1 of 1" in result.stderr
    report = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in report["items"]] == ["done", "done"]
    # With no retry left the item is reported failed and the batch still finishes.
    (tmp_path / "fired").unlink()
    no_retry = [a if a != "1" or args[k - 1] != "--retries" else "0" for k, a in enumerate(args)]
    result = runner.invoke(app, [*no_retry, "--overwrite"])
    assert result.exit_code == 1
    report = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in report["items"]] == ["done", "failed"]
    assert report["items"][1]["attempts"] == 1 and "injected fault" in report["items"][1]["error"]
