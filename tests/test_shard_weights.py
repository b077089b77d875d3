"""`--shard-weights` (FSDP2 over the cp group) composed with ring, Ulysses and DiTango: the
same latents as the unsharded run of the same strategy, with half the weights per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditango_cli.app import app
from runtime.weights import block_stacks

TOL = 1e-5
SMALL = ["--prompt", "a green circle moving up", "--steps", "3", "--height", "32", "--width", "32", "--frames", "5",
         "--device", "cpu", "--quiet", "--save-latents", "--executor", "local", "--gpus", "2"]  # fmt: skip


def _run(runner, out: Path, *extra: str) -> tuple[torch.Tensor, dict]:
    result = runner.invoke(app, ["generate", *SMALL, "--out", str(out), *extra])
    assert result.exit_code == 0, result.stderr
    (latents,) = out.glob("*.latents.safetensors")
    return load_file(latents)["latents"], json.loads((out / "report.json").read_text())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(["--parallel", "ring"], id="ring"),
        pytest.param(["--parallel", "ulysses"], id="ulysses", marks=pytest.mark.sweep),
        pytest.param(["--parallel", "ditango", "--group-size", "1"], id="ditango", marks=pytest.mark.sweep),
    ],
)
@pytest.mark.distributed
def test_sharded_weights_give_the_unsharded_latents(runner, tmp_path, strategy):
    whole, whole_report = _run(runner, tmp_path / "whole", *strategy)
    sharded, report = _run(runner, tmp_path / "sharded", *strategy, "--shard-weights")
    err = (sharded - whole).abs().max().item()
    assert err <= TOL, err
    assert whole_report["weights"]["shard_degree"] == 1 and report["weights"]["shard_degree"] == 2
    # Half the transformer and text encoder on each rank, but the float32 pieces kept whole.
    ratio = report["weights"]["param_bytes_per_rank"] / whole_report["weights"]["param_bytes_per_rank"]
    assert 0.5 <= ratio < 0.55, ratio


def test_shard_weights_refuses_hybrid(runner, tmp_path):
    result = runner.invoke(
        app, ["generate", *SMALL, "--out", str(tmp_path / "o"), "--cfg-parallel", "--hybrid", "--shard-weights"]
    )
    assert result.exit_code == 2
    assert "--shard-weights does not combine with --hybrid" in result.stderr


def test_block_stacks_are_the_models_blocks(parity_components):
    transformer, encoder = parity_components["transformer"], parity_components["text_encoder"]
    assert block_stacks(transformer) == list(transformer.blocks)
    assert block_stacks(encoder) == list(encoder.encoder.block)


def test_offloaded_components_move_and_sharded_ones_stay():
    from runtime.weights import place

    whole = torch.nn.Linear(2, 2)
    place([whole], torch.device("meta"))
    assert whole.weight.device.type == "meta"

    class Sharded(torch.nn.Linear):  # FSDP2's modules have unshard(): never moved whole
        def unshard(self): ...

    sharded = Sharded(2, 2)
    place([sharded], torch.device("meta"))
    assert sharded.weight.device.type == "cpu"
