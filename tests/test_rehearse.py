"""`ditango rehearse`: a registry model's rank program on fake GPUs at reduced size, checked
against the memory model and planner/traffic.py; a planted device defect makes it fail."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from ditango_cli.app import app
from runtime.models.meta import meta_components
from runtime.models.registry import REGISTRY

RUNNER = CliRunner()
# Wan2.1-1.3B (12 heads, 30 layers) at 480x832, 9 frames: 3 latent frames, 4,680 tokens
SMALL = ["--model", "wan2.1-1.3b", "--height", "480", "--width", "832", "--frames", "9", "--steps", "12",
         "--nodes", "2", "--gpus-per-node", "2", "--json"]  # fmt: skip


@functools.cache  # a rehearsal two tests read runs once
def rehearse(*args: str) -> tuple[int, dict | None, str]:
    result = RUNNER.invoke(app, ["rehearse", *args])
    try:
        return result.exit_code, json.loads(result.stdout), result.stderr
    except json.JSONDecodeError:
        return result.exit_code, None, result.stdout + result.stderr


def test_meta_components_match_the_registry_counts():
    for name in ("wan2.1-14b", "hunyuanvideo"):
        parts = meta_components(REGISTRY[name], None, torch.bfloat16, 512)
        assert all(p.is_meta for m in parts.values() if isinstance(m, torch.nn.Module) for p in m.parameters())
        text = sum(p.numel() for n in ("text_encoder", "text_encoder_2") if n in parts for p in parts[n].parameters())
        assert text == REGISTRY[name].named.text.params
        assert sum(p.numel() for p in parts["transformer"].parameters()) == REGISTRY[name].params
    wan = meta_components(REGISTRY["wan2.1-14b"], None, torch.bfloat16, 512)["transformer"]
    kept = {n for n, p in wan.named_parameters() if p.dtype == torch.float32}  # as from_pretrained keeps them
    assert "scale_shift_table" in kept and "blocks.0.norm2.weight" in kept and "blocks.0.ffn.net.2.weight" not in kept


def test_fsdp_counts_match_the_meta_builds():
    """What --shard-weights gathers per forward (the non-root FSDP units but their float32
    parameters) and once (the root's), as runtime/weights.py shards each registry model."""
    from runtime.weights import _main_dtype, block_stacks

    for name in ("wan2.1-1.3b", "wan2.1-i2v-14b-480p", "hunyuanvideo"):
        spec = REGISTRY[name]
        transformer = meta_components(spec, None, torch.bfloat16, 512)["transformer"]
        main = _main_dtype(transformer)
        units = {id(p) for b in block_stacks(transformer) for p in b.parameters()}
        gathered = sum(p.numel() for b in block_stacks(transformer) for p in b.parameters() if p.dtype == main)
        root = sum(p.numel() for p in transformer.parameters() if id(p) not in units and p.dtype == main)
        assert (gathered, root) == (spec.named.fsdp_gathered, spec.named.fsdp_root_gathered)
        assert (spec.shape.fsdp_gathered_params, spec.shape.fsdp_root_gathered_params) == (gathered, root)


@pytest.mark.e2e
def test_hunyuan_reads_the_device_once_a_forward():
    """HunyuanVideo's joint attention read its text mask on the host in every block (a wait for
    the GPU 60 times a forward); now only the forward's text padding is read."""
    code, report, err = rehearse(
        "--model",
        "hunyuanvideo",
        "--height",
        "256",
        "--width",
        "256",
        "--frames",
        "9",
        "--steps",
        "4",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--parallel",
        "ring",
        "--json",
    )
    assert report is not None, err
    assert code == 0, report["problems"]
    for rank in report["ranks"]:
        reads = {r["site"]: r["count"] for r in rank["host_reads"] if r["phase"] == "denoise" and r["device"] == "cuda"}
        assert not any("JointAttention" in site or "__call__" in site for site in reads), reads
        assert sum(reads.values()) <= 2 * len(rank["steps"]) + 1, reads  # a forward's padding, the loop's end
        assert rank["bytes_per_step"] == rank["modelled_bytes_per_step"]


@pytest.mark.slow  # 5.5 to 8.5 min on 2 cores: a 7B text encoder, 2 x 2 forwards of 54 blocks, 4 VAE tiles
@pytest.mark.e2e
def test_hunyuan15_720p_rehearses_within_the_memory_model():
    """HunyuanVideo-1.5 720p (1280x720x121, 111,600 tokens) on 1 node of 8 GPUs. Bugs: its
    forward's boolean text reorder stopped the rehearsal in the denoise (see
    test_a_boolean_selection_keeps_every_valid_token); its VAE's shape counted each upsampled
    resolution at the wider block's channels, which modelled the tiled decode twice what it
    holds (66.2 GiB against 43.1 traced on rank 0)."""
    code, report, err = rehearse(
        "--model", "hunyuanvideo-1.5-720p-t2v", "--nodes", "1", "--gpus-per-node", "8", "--parallel", "ring", "--json"
    )
    assert report is not None, err
    assert code == 0, report["problems"]
    assert (report["item"]["width"], report["item"]["height"], report["item"]["frames"]) == (1280, 720, 121)
    assert [r["rank"] for r in report["ranks"]] == [0, 7]
    for rank in report["ranks"]:
        assert set(rank["phases"]) == {"load", "encode", "denoise", "decode"}
        assert abs(rank["peak"]["ratio"] - 1) <= 0.15, rank["peak"]
        for phase in rank["phases"].values():
            assert abs(phase["traced_bytes"] / phase["modelled_bytes"] - 1) <= 0.15, rank["phases"]
        assert rank["bytes_per_step"] == rank["modelled_bytes_per_step"]
        # every text token counted: the forward's selections and the padding cut, read a forward
        reads = [
            r for r in rank["host_reads"] if r["phase"] == "denoise" and "transformer_hunyuan_video15" in r["site"]
        ]
        assert reads and all(r["count"] == 2 * len(rank["steps"]) for r in reads), reads


@pytest.mark.parametrize(
    "parallel",
    [
        ["--parallel", "usp"],
        ["--parallel", "tp"],
        pytest.param(["--parallel", "ditango", "--group-size", "node"], marks=pytest.mark.slow),
        pytest.param(["--parallel", "ring", "--shard-weights"], marks=pytest.mark.slow),
        # Hybridiff's stage test ran in float64 on the GPU; the step cache's agreement was not counted
        pytest.param(["--parallel", "ring", "--cfg-parallel", "--hybrid"], marks=pytest.mark.slow),
        pytest.param(["--parallel", "usp", "--step-cache", "first-block"], marks=pytest.mark.slow),
    ],
)
@pytest.mark.e2e
def test_small_rehearsal_agrees_with_the_models(parallel):
    code, report, err = rehearse(*SMALL, *parallel)
    assert report is not None, err
    assert code == 0, report["problems"]
    cfg_groups = "--cfg-parallel" in parallel  # the second branch's first rank too
    assert [r["rank"] for r in report["ranks"]] == ([0, 2, 3] if cfg_groups else [0, 3])  # writer, last: equal chunks
    for rank in report["ranks"]:
        assert set(rank["phases"]) == {"load", "encode", "denoise", "decode"}
        assert (
            set(rank["peak"]) == {"traced_bytes", "modelled_bytes", "ratio"} and abs(rank["peak"]["ratio"] - 1) <= 0.15
        )
        for name, phase in rank["phases"].items():
            # FSDP's initialisation on rank 0 holds one more copy of the text encoder's root than the
            # model counts (docs/rehearse.md: the open discrepancy); load is not the peak phase
            slack = 0.5 if "--shard-weights" in parallel and name == "load" and rank["rank"] == 0 else 0.15
            assert phase["traced_bytes"] > 0 and abs(phase["traced_bytes"] / phase["modelled_bytes"] - 1) <= slack
        assert rank["bytes_per_step"] == rank["modelled_bytes_per_step"]
        assert rank["problems"] == []
    assert sum(r["bytes_per_step"]["inter_node_bytes"] for r in report["ranks"]) > 0  # two nodes: something crosses
    if "tp" in parallel:  # loaded on the CPU and split there: no GPU holds the whole transformer
        assert all(
            r["phases"]["load"]["traced_bytes"] < r["phases"]["denoise"]["traced_bytes"] for r in report["ranks"]
        )
    kinds = [s["kind"] for s in report["steps_rehearsed"]]
    assert kinds == (["exact", "anchor", "selective"] if "ditango" in parallel else ["exact", "exact"])
    if "--shard-weights" in parallel:  # FSDP's weight gathers cross the nodes every step
        assert all(s["collectives"].get("_allgather_base_", 0) >= 30 for r in report["ranks"] for s in r["steps"])


def test_a_boolean_selection_keeps_every_valid_token():
    """Bug: HunyuanVideo-1.5's forward puts the valid text tokens first by boolean indexing
    (diffusers' transformer_hunyuan_video15.py), which has no size on fake tensors
    (aten.nonzero: DynamicOutputShapeException), so its rehearsal failed in the denoise. Now a
    mask of unknown values selects every element and its negation none, a mask made by a fill
    its own value, a write into it forgets that; each selection is a read (a GPU waits)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runtime.rehearse.fake_gpu import fake_cuda
    from runtime.rehearse.watch import Watch

    gpu = torch.device("cuda", 0)
    watch = Watch(0, gpu, (0,), {})
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), fake_cuda(1, 0, 2**30, lambda: 0), watch:
        text, text_mask = torch.empty(1, 1000, 8, device=gpu), torch.empty(1, 1000, device=gpu, dtype=torch.bfloat16)
        glyph, glyph_mask = torch.empty(1, 256, 8, device=gpu), torch.zeros(1, 256, device=gpu, dtype=torch.long)
        image = torch.empty(1, 729, 8, device=gpu)
        image_mask = torch.zeros(1, 729, device=gpu, dtype=text_mask.dtype)  # text-to-video: no image token
        rows = []
        for t, tm, g, gm, i, im in zip(
            text, text_mask.bool(), glyph, glyph_mask.bool(), image, image_mask.bool(), strict=True
        ):
            rows.append([len(x) for x in (i[im], g[gm], t[tm], i[~im], g[~gm], t[~tm])])
        assert rows == [[0, 0, 1000, 729, 256, 0]]
        assert torch.nonzero(torch.ones(3, 4, device=gpu)).shape == (12, 2)
        assert torch.nonzero(torch.zeros(3, 4, device=gpu)).shape == (0, 2)
        assert bool((torch.zeros(2, device=gpu) == 0).all())  # a read answered by the fill's value
        assert not bool(torch.zeros(2, device=gpu, dtype=torch.bool).any())
        written = torch.zeros(4, device=gpu, dtype=torch.bool)
        written[1:3].fill_(True)  # a view's write: the whole no longer one value
        assert watch.known.get(written) is None and len(text[0][written]) == 4  # unknown: every element
    assert watch.problems == {}
    assert sum(watch.reads.values()) == 6 * 1 + 2 + 2 + 1  # the selections, nonzeros, reads, the last


def test_a_tensor_made_without_device_is_a_problem(monkeypatch):
    """A planted defect: the ring's merge adds a host tensor (no device=) to the GPU state."""
    import runtime.strategies.ring as ring

    merge = ring.merge

    def planted(a, b):
        out = merge(a, b)
        return type(out)(out.out_BSHD + torch.zeros(out.out_BSHD.shape[-1]), out.lse_BSH)

    monkeypatch.setattr(ring, "merge", planted)
    code, report, err = rehearse(*SMALL[:-5], "--nodes", "1", "--gpus-per-node", "2", "--parallel", "ring", "--json")
    assert report is not None, err
    assert code == 1
    named = [p for p in report["problems"] if "runtime/strategies/ring.py" in p and "cpu" in p]
    assert named, report["problems"]  # the op mixing devices, in the strategy that called it
    assert all(p.startswith("rank ") for p in report["problems"])


def test_the_table_names_every_problem(capsys):
    """Without --json: one row per rank (traced/modelled) and every problem on its own line."""
    from ditango_cli.rehearse import show

    phase = {"traced_bytes": 3 * 2**30, "modelled_bytes": 2 * 2**30, "ratio": 1.5}
    rank = {
        "rank": 7,
        "node": 1,
        "phases": {"denoise": phase},
        "peak": phase,
        "problems": ["x"],
        "bytes_per_step": {"inter_node_bytes": 10**9, "intra_node_bytes": 0},
        "modelled_bytes_per_step": {"inter_node_bytes": 10**9, "intra_node_bytes": 0},
    }
    report = {
        "model": "m",
        "item": {"width": 8, "height": 8, "frames": 1, "tokens": 4},
        "gpu_memory_bytes": 80 * 2**30,
        "layout": {"nodes": 2, "gpus_per_node": 4, "strategy": "ring"},
        "steps_rehearsed": [],
        "offload": [],
        "ranks": [rank],
        "problems": ["rank 7: traced peak 3.00 GiB, the memory model says 2.00 GiB (1.5x)"],
    }
    show(report)
    out = capsys.readouterr().out
    assert "3.0/2.0" in out and "1.00/1.00" in out and "problem: rank 7: traced peak 3.00 GiB" in out
    assert "no problem found" not in out


@pytest.mark.e2e
def test_an_fp8_rehearsal_loads_a_byte_a_quantized_weight():
    """--quantize fp8 at real scale: every rank's load holds the blocks' linear weights at one
    byte (plus a float32 scale a row) instead of two, each layer quantized as it reaches the
    GPU (no rank ever holds the whole bf16 transformer), and traced agrees with the model."""
    from planner.precision import quantized_counts

    usp = [*SMALL, "--parallel", "usp"]
    (code, bf16, err), (code8, fp8, err8) = rehearse(*usp), rehearse(*usp, "--quantize", "fp8")
    assert bf16 is not None and fp8 is not None, (err, err8)
    assert code == code8 == 0, fp8["problems"]
    weights, rows = quantized_counts(REGISTRY["wan2.1-1.3b"].shape)
    saved = weights * (2 - 1) - rows * 4  # bf16 -> e4m3, plus the scales
    for a, b in zip(bf16["ranks"], fp8["ranks"], strict=True):
        drop = a["phases"]["load"]["traced_bytes"] - b["phases"]["load"]["traced_bytes"]
        assert abs(drop / saved - 1) <= 0.05, (drop, saved)
        for phase in b["phases"].values():
            assert abs(phase["traced_bytes"] / phase["modelled_bytes"] - 1) <= 0.15


@pytest.mark.e2e
def test_an_offloaded_text_encoder_is_rehearsed():
    """Bug: a text encoder the pre-flight offloads (a 16 GiB GPU for wan2.1-1.3b) is moved to the
    GPU to encode and back; nn.Module.to swapped fake tensors the memory trackers reference,
    and every such rehearsal failed in its encode phase."""
    code, report, err = rehearse(
        *("--model", "wan2.1-1.3b", "--height", "480", "--width", "832", "--frames", "9", "--steps", "2"),
        *("--nodes", "1", "--gpus-per-node", "1", "--gpu-memory", "16GiB", "--json"),
    )
    assert report is not None, err
    assert report["offload"] == ["text_encoder"]
    (rank,) = report["ranks"]
    assert rank["problems"] == [] and code == 0, (rank["problems"], err)
    assert set(rank["phases"]) >= {"encode", "denoise", "decode"}
