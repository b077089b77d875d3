"""Model loading: the shipped built-in model goes through the checkpoint path; dtype handling."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.models.checkpoint import inspect_model_dir
from runtime.models.loading import load_components, resolve_placement
from runtime.models.registry import BUILTIN_DIR, REGISTRY
from runtime.models.resolve import resolve_model
from tiny_wan import TRAINED_ARCH, build_tiny_wan


def test_builtin_is_a_checked_diffusers_directory_within_budget():
    resolved = resolve_model("tiny-wan")
    assert resolved.path == BUILTIN_DIR
    info = inspect_model_dir(BUILTIN_DIR)  # the same validation a user's Wan2.1 directory gets
    assert info.transformer_params == REGISTRY["tiny-wan"].params
    size = sum(p.stat().st_size for p in BUILTIN_DIR.rglob("*") if p.is_file())
    assert size <= 30 * 2**20, size
    assert not list(BUILTIN_DIR.rglob("*.bin")) and not list(BUILTIN_DIR.rglob("*.pt"))  # safetensors only


def test_registry_describes_the_shipped_transformer():
    """The registry's shape (what the cost model and `check` read) must match the weights."""
    cfg = json.loads((BUILTIN_DIR / "transformer" / "config.json").read_text())
    want = (cfg["num_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"], tuple(cfg["patch_size"]))
    spec = REGISTRY["tiny-wan"]
    shape = spec.shape
    assert (spec.layers, spec.heads, spec.head_dim, spec.defaults.patch) == want
    assert (shape.layers, shape.heads, shape.head_dim, shape.patch) == want
    assert (shape.ffn, shape.text_dim, shape.latent_channels) == (cfg["ffn_dim"], cfg["text_dim"], cfg["in_channels"])
    assert (TRAINED_ARCH.layers, TRAINED_ARCH.heads, TRAINED_ARCH.head_dim, TRAINED_ARCH.patch_size) == want


def test_shipped_frozen_parts_equal_the_code_that_defines_them():
    """The text encoder is frozen at its seeded initialisation and the VAE is closed-form:
    the shipped files must be exactly what build_tiny_wan(TRAINED_ARCH) makes."""
    loaded = load_components(resolve_model("tiny-wan"), resolve_placement("cpu"))
    built = build_tiny_wan(TRAINED_ARCH)
    for name in ("text_encoder", "vae"):
        a, b = built[name].state_dict(), loaded[name].state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
    assert loaded["vae"].config.scale_factor_spatial == 4


def test_bf16_load_keeps_float32_modules_and_fp32_vae():
    parts = load_components(resolve_model("tiny-wan"), resolve_placement("cpu", "bfloat16"))
    kinds = {p.dtype for p in parts["transformer"].parameters()}
    assert kinds == {torch.float32, torch.bfloat16}  # diffusers' keep-in-fp32 modules survived
    assert {p.dtype for p in parts["vae"].parameters()} == {torch.float32}
    assert parts["text_encoder"].dtype == torch.bfloat16


def test_default_dtype_per_device():
    assert resolve_placement("cpu").dtype == torch.float32
    assert resolve_placement("cpu", "bfloat16").dtype == torch.bfloat16


def test_registry_parameter_counts_are_those_of_the_configs():
    """Each named model's parameter count restates what its transformer config builds (on the
    meta device), for every family."""
    from runtime.models.families import FAMILIES

    named = [(f, m) for f in FAMILIES.values() for m in f.MODELS]
    assert len(named) >= len(FAMILIES) and all(m.params > 0 for _, m in named)
    assert {m.name: family.count_params(m.transformer) for family, m in named} == {m.name: m.params for _, m in named}
    a14b = REGISTRY["wan2.2-t2v-a14b"]
    assert a14b.params == 2 * a14b.named.params  # two experts loaded


def test_components_are_those_the_pipeline_class_loads():
    """Each module read by its own class (runtime/models/loading.py) equals what the pipeline
    class's from_pretrained made before, parameter by parameter: name, dtype and value (the
    float32 VAE, the modules diffusers keeps in float32 in a bfloat16 transformer)."""
    from diffusers import WanPipeline

    from runtime.models.loading import _dtype_kwarg

    dtypes = {"default": torch.bfloat16, "vae": torch.float32}
    pipe = WanPipeline.from_pretrained(str(BUILTIN_DIR), local_files_only=True, **{_dtype_kwarg(WanPipeline): dtypes})
    loaded = load_components(resolve_model("tiny-wan"), resolve_placement("cpu", "bfloat16"))
    assert sorted(loaded) == sorted(k for k, v in pipe.components.items() if v is not None)
    for name in ("text_encoder", "transformer", "vae"):
        want, got = pipe.components[name].state_dict(), loaded[name].state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), (name, key)
        assert not loaded[name].training and not any(p.requires_grad for p in loaded[name].parameters())


def test_each_component_is_read_onto_its_own_device(monkeypatch):
    """The bug: every rank loaded the whole pipeline into host memory, then moved it (8 ranks of a
    node: 8 host copies). Each module now goes straight to its device (no module built on the
    CPU is moved off it); `on_cpu` ones to the CPU, in their dtype. The meta device stands in
    for a GPU (the CPU suite has none)."""
    from runtime.models.loading import Placement

    moved_off_host = []
    module_to = torch.nn.Module.to

    def spy(module, *args, **kwargs):
        on_host = any(p.device.type == "cpu" for p in module.parameters())
        result = module_to(module, *args, **kwargs)
        if on_host and not any(p.device.type == "cpu" for p in result.parameters()):
            moved_off_host.append(type(module).__name__)
        return result

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    placement = Placement(torch.device("meta"), torch.bfloat16)
    parts = load_components(resolve_model("tiny-wan"), placement, on_cpu=("transformer",))
    assert moved_off_host == []
    devices = {n: {p.device.type for p in parts[n].parameters()} for n in ("text_encoder", "transformer", "vae")}
    assert devices == {"text_encoder": {"meta"}, "transformer": {"cpu"}, "vae": {"meta"}}
    assert {p.dtype for p in parts["transformer"].parameters()} == {torch.float32, torch.bfloat16}
    assert {p.dtype for p in parts["vae"].parameters()} == {torch.float32}
    assert parts["text_encoder"].dtype == torch.bfloat16
    assert not hasattr(parts["transformer"], "hf_device_map")  # later moves (FSDP, offload) stay plain


@pytest.mark.parametrize("family", ["hunyuanvideo", "i2v-clip"])
def test_every_weighted_component_of_a_family_is_read_onto_the_device(tmp_path, family):
    """Not only Wan2.1's three: HunyuanVideo's second text encoder and Wan I2V's CLIP image
    encoder were read by the pipeline class onto the host (a host copy per rank) before."""
    from diffusers import HunyuanVideoPipeline, WanImageToVideoPipeline

    from runtime.models.checkpoint import WEIGHTED
    from runtime.models.loading import Placement
    from tiny_wan import TinyWanConfig, build_tiny_wan
    from tiny_wan.build import pipeline_kwargs
    from tiny_wan.hunyuan import build_tiny_hunyuan

    path = tmp_path / family
    if family == "hunyuanvideo":
        HunyuanVideoPipeline(**build_tiny_hunyuan()).save_pretrained(path, safe_serialization=True)
    else:
        cfg = TinyWanConfig(image="clip", heads=4, head_dim=8, layers=1, ffn_dim=32, text_dim=24, text_heads=2)
        WanImageToVideoPipeline(**build_tiny_wan(cfg), **pipeline_kwargs(cfg)).save_pretrained(
            path, safe_serialization=True
        )
    parts = load_components(resolve_model(str(path)), Placement(torch.device("meta"), torch.bfloat16))
    weighted = [n for n in WEIGHTED if isinstance(parts.get(n), torch.nn.Module)]
    assert {"text_encoder_2" if family == "hunyuanvideo" else "image_encoder"} <= set(weighted)
    for name in weighted:
        assert {p.device.type for p in parts[name].parameters()} == {"meta"}, name


@pytest.mark.parametrize(
    ("version", "want"),
    [("4.50.3", "torch_dtype"), ("4.55.4", "torch_dtype"), ("4.56.0", "dtype"), ("5.0.0rc1", "dtype")],
)
def test_a_transformers_class_gets_the_dtype_by_the_name_its_release_knows(monkeypatch, version, want):
    import transformers
    from transformers import CLIPTextModel

    from runtime.models.loading import _dtype_kwarg

    monkeypatch.setattr(transformers, "__version__", version)
    assert _dtype_kwarg(CLIPTextModel) == want
