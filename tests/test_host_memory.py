"""Host memory of a rank and a node (planner/host_memory.py) and what a Slurm submission asks
for from it: `--mem` per node and `--cpus-per-task` unless given, `--exclusive` when asked."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ditango_cli.app import app
from planner.host_memory import (
    CPUS_PER_RANK,
    NODE_RESERVE_BYTES,
    RANK_BASE_CPU_BYTES,
    RANK_BASE_GPU_BYTES,
    SHARD_BYTES,
    host_memory,
    mem_request,
)
from planner.layout import ParallelLayout
from planner.memory import GIB, MemoryOptions
from runtime.config import Item, RunConfig
from runtime.memory_plan import plan_host_memory
from runtime.models.registry import REGISTRY
from slurm.launchers.sbatch import sbatch_script
from slurm.options import SlurmOptions

WAN14B = REGISTRY["wan2.1-14b"].shape
ONE_NODE_OF_8 = ParallelLayout(1, 8, strategy="ring")


def wan14b_config(**fields) -> RunConfig:
    item = Item("a", "a red circle", "", 0, 480, 832, 81, 50, 5.0)
    return RunConfig(
        "wan2.1-14b", Path("/models/wan"), (item,), Path("/out"), device="cuda", layout=ONE_NODE_OF_8, **fields
    )


def test_wan14b_eight_ranks_per_node_bf16():
    """wan2.1-14b, 8 GPU ranks on a node, bfloat16, nothing sharded or offloaded: a rank keeps
    nothing on the host but its process (3 GiB = 3,221,225,472 B) and the file it reads (the
    transformer is 14,288,491,584 params x 4 B on disk = 57 GB, so one 10 GB shard):
        per rank = 3,221,225,472 + 10,000,000,000 = 13,221,225,472
        per node = ceil(8 x 13,221,225,472 x 1.10) + 4 GiB = 116,346,784,154 + 4,294,967,296
                 = 120,641,751,450 B = 112.4 GiB -> --mem=113G."""
    est = host_memory(WAN14B, ONE_NODE_OF_8, MemoryOptions(dtype_bytes=2), 8, on_gpu=True)
    assert est.per_rank == 13_221_225_472
    assert est.per_node == 120_641_751_450
    assert est.mem_request == "113G"
    # What build_run_config records on the RunConfig is the same figure.
    assert plan_host_memory(wan14b_config(), WAN14B, 2).host_memory == 120_641_751_450


def test_host_loaded_and_offloaded_components_count_whole():
    """--shard-weights loads the transformer and the text encoder whole onto the CPU of every
    rank first (runtime/weights.py): (14,288,491,584 + 5,680,910,336) x 2 B = 39,938,803,840
    per rank beside the file being read: per rank 53,160,029,312, per node
    ceil(8 x 53,160,029,312 x 1.1) + 4 GiB = 472,103,225,242 B -> 440G. Offloading the text
    encoder (unsharded) keeps 11,361,820,672 B on the host after encoding, less than the load's
    transient shard here, so the rank's peak stays the load's."""
    sharded = host_memory(WAN14B, ONE_NODE_OF_8, MemoryOptions(shard_weights=True), 8, on_gpu=True)
    assert sharded.parts["load"] == 39_938_803_840
    assert sharded.per_node == 472_103_225_242 and sharded.mem_request == "440G"
    tp = host_memory(WAN14B, replace(ONE_NODE_OF_8, strategy="tp"), MemoryOptions(), 8, on_gpu=True)
    assert tp.parts["load"] == WAN14B.params * 2  # the transformers, cut on the CPU
    offload = MemoryOptions(offload_text_encoder=True, offload_transformer=True)
    both = host_memory(WAN14B, ONE_NODE_OF_8, offload, 8, on_gpu=True)
    assert both.parts["run"] == (WAN14B.params + WAN14B.text_encoder_params) * 2
    assert both.per_rank == RANK_BASE_GPU_BYTES + both.parts["run"]  # 39.9 GB on the host outgrows the shard
    one = host_memory(WAN14B, ParallelLayout(1, 1), MemoryOptions(shard_weights=True), 1, on_gpu=True)
    assert one.parts["load"] == 0  # one rank shards nothing: straight onto its GPU


def test_cpu_ranks_hold_their_whole_peak_on_the_host():
    est = host_memory(WAN14B, ONE_NODE_OF_8, MemoryOptions(dtype_bytes=4), 2, on_gpu=False, device_peak=70 * GIB)
    assert est.per_rank == RANK_BASE_CPU_BYTES + 70 * GIB + SHARD_BYTES
    assert est.per_node == -(-2 * est.per_rank * 11 // 10) + NODE_RESERVE_BYTES
    assert mem_request(GIB) == "1G" and mem_request(GIB + 1) == "2G"


def test_sbatch_script_requests_cpus_and_memory_and_overrides_win(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "slurm.launchers.sbatch.partition_nodes", lambda partition: None
    )  # not this host's Slurm, if any
    cfg = plan_host_memory(wan14b_config(), WAN14B, 2)
    lines = sbatch_script(cfg, SlurmOptions(), tmp_path, 1).splitlines()
    assert f"#SBATCH --cpus-per-task={CPUS_PER_RANK}" in lines and "#SBATCH --mem=113G" in lines
    assert "#SBATCH --exclusive" not in lines
    given = SlurmOptions(cpus_per_task=16, mem="500G", exclusive=True)
    lines = sbatch_script(cfg, given, tmp_path, 1).splitlines()
    assert "#SBATCH --cpus-per-task=16" in lines and "#SBATCH --mem=500G" in lines
    assert "#SBATCH --exclusive" in lines
    assert not [x for x in lines if x.startswith(("#SBATCH --mem=1", "#SBATCH --cpus-per-task=8"))]


@pytest.fixture
def login_node(monkeypatch, tmp_path):
    """No Slurm installed, outside any allocation, no GPU here (the job asks for them)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path") + os.pathsep + str(Path(sys.executable).parent))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_dry_run_script_has_the_requests(runner, login_node, tmp_path):
    """`generate --dry-run --executor slurm` prints the requests; --mem/--cpus-per-task given win."""
    argv = [
        "generate",
        "--prompt",
        "a red ball",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "64",
        "--frames",
        "5",
        "--executor",
        "slurm",
        "--gpus",
        "4",
        "--dry-run",
        "--json",
        "--out",
        str(tmp_path / "o"),
    ]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.stderr
    lines = json.loads(result.stdout)["sbatch_script"].splitlines()
    tiny = REGISTRY["tiny-wan"].shape
    want = host_memory(
        tiny, ParallelLayout(1, 4, strategy="ring"), MemoryOptions(dtype_bytes=2), 4, on_gpu=True
    ).mem_request
    assert "#SBATCH --cpus-per-task=8" in lines and f"#SBATCH --mem={want}" in lines, lines
    result = runner.invoke(app, [*argv, "--mem", "64G", "--cpus-per-task", "4", "--exclusive"])
    assert result.exit_code == 0, result.stderr
    lines = json.loads(result.stdout)["sbatch_script"].splitlines()
    assert {"#SBATCH --cpus-per-task=4", "#SBATCH --mem=64G", "#SBATCH --exclusive"} <= set(lines)


def test_requests_fit_the_partitions_smallest_node(tmp_path, monkeypatch):
    """sbatch refuses a job no node can hold: where sinfo tells the partition's nodes, CPUs per
    task are at most a node's CPUs over its ranks, and the memory at most the smallest node's,
    with a note that says so (the local test cluster: 2 CPUs and 4000 MiB a node)."""
    from slurm.jobs import partition_nodes
    from slurm.options import NodeSize, host_request

    cfg = replace(
        wan14b_config(), layout=ParallelLayout(1, 2, strategy="ring"), alloc_gpus_per_node=2, host_memory=30 * GIB
    )
    assert host_request(cfg, SlurmOptions()) == (CPUS_PER_RANK, "30G", "")
    assert host_request(cfg, SlurmOptions(), NodeSize(cpus=224, mem_mib=2_000_000)) == (CPUS_PER_RANK, "30G", "")
    cpus, mem, note = host_request(cfg, SlurmOptions(), NodeSize(cpus=2, mem_mib=4000))
    assert (cpus, mem) == (1, "4000M") and "30G" in note and "4000M" in note and "--mem overrides" in note
    assert host_request(cfg, SlurmOptions(mem="64G", cpus_per_task=4), NodeSize(2, 4000)) == (4, "64G", "")
    # What is compared is what is asked for: 29.5 GiB asks 30G, more than a node of 30000 MiB.
    half = replace(cfg, host_memory=int(29.5 * GIB))
    assert host_request(half, SlurmOptions(), NodeSize(224, 30_000))[1] == "30000M"
    assert host_request(half, SlurmOptions(), NodeSize(224, 30 * 1024)) == (CPUS_PER_RANK, "30G", "")
    # A --constraint picks other nodes than the partition's smallest: nothing is cut.
    assert host_request(cfg, SlurmOptions(constraint="h100"), NodeSize(2, 4000)) == (CPUS_PER_RANK, "30G", "")

    fake = tmp_path / "bin" / "sinfo"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\nfor a in \"$@\"; do case $a in --partition=gpu) echo '96 1000000 gpu'; "
        "echo '64+ 500000+ gpu'; exit 0;; esac; done\necho '2 4000 debug*'\necho '128 900000 gpu'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert partition_nodes(None) == (2, 4000)  # the default partition, starred
    assert partition_nodes("gpu") == (64, 500000)  # mixed nodes: the smallest
