"""Model loading: the built-in model goes through the checkpoint path; dtype handling."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.models.loading import load_components, resolve_placement
from runtime.models.registry import resolve_model
from runtime.models.tiny import TINY_WAN, build_tiny_wan, materialize


def test_materialized_builtin_equals_built_in_code(tmp_path):
    path = materialize(TINY_WAN, root=tmp_path)
    assert materialize(TINY_WAN, root=tmp_path) == path  # cached, not rewritten
    from diffusers import WanTransformer3DModel

    loaded = WanTransformer3DModel.from_pretrained(path / "transformer", use_safetensors=True)
    built = build_tiny_wan()["transformer"]
    for (name, a), (_, b) in zip(built.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_load_keeps_float32_modules_and_fp32_vae(tmp_path, monkeypatch):
    monkeypatch.setenv("DITANGO_CACHE_DIR", str(tmp_path))
    parts = load_components(resolve_model("tiny-wan"), resolve_placement("cpu", "bfloat16"))
    kinds = {p.dtype for p in parts["transformer"].parameters()}
    assert kinds == {torch.float32, torch.bfloat16}  # diffusers' keep-in-fp32 modules survived
    assert {p.dtype for p in parts["vae"].parameters()} == {torch.float32}
    assert parts["text_encoder"].dtype == torch.bfloat16


def test_default_dtype_per_device():
    assert resolve_placement("cpu").dtype == torch.float32
    assert resolve_placement("cpu", "bfloat16").dtype == torch.bfloat16


def _materialize_target(rank, world, events, root):
    from runtime.models.checkpoint import inspect_model_dir

    path = materialize(TINY_WAN, root=root)  # inside an initialized process group
    inspect_model_dir(path)  # complete, whichever process wrote it
    return str(path)


def test_concurrent_materialize_yields_one_complete_directory(tmp_path):
    """Guards a bug seen with 4 local ranks building the cache: transformers' save_pretrained
    writes nothing on ranks != 0 of an initialized process group (an empty text_encoder/)."""
    from slurm.local import run_ranks

    paths = run_ranks(_materialize_target, 3, (tmp_path,), timeout_s=60)
    assert len(set(paths)) == 1
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == [Path(paths[0]).name]
