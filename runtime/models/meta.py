"""A model's pipeline components built from their configs on the meta device: every module at
its real shape and in the dtypes the loader gives it (runtime/models/loading.py), with no
weight read. `ditango rehearse` (runtime/rehearse/) moves them onto fake GPUs.

A registry name is built from its named model's configs (runtime/models/<family>/models.py) and
its family's other components (the public checkpoints' text encoders and schedulers:
runtime/models/<family>/checkpoint.py); a directory from its own components' config files
(each class's own: config.json, scheduler_config.json, a guider's), with a stand-in tokenizer
for each text encoder. Token ids come from `ShapeTokenizer`: a
prompt of the longest length the pipeline asks for, which is what the memory model assumes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from basics.errors import ConfigError
from basics.user_files import read_json_file
from runtime.models import registry
from runtime.models.families import FAMILIES, find_class
from runtime.models.registry import ModelSpec


class ShapeTokenizer:
    """Token ids of the right shape for a text encoder: `max_length` tokens with every one
    valid (the longest prompt, the memory model's case), id 1 (any id inside the vocabulary
    gives the same shapes). Enough of a tokenizer for diffusers' prompt encoding."""

    model_max_length = 1 << 20
    pad_token = eos_token = "<pad>"  # a pipeline that sets its padding (LTX-2's Gemma) finds one
    padding_side = "left"

    def __init__(self, length: int = 16) -> None:
        self.length = length  # without padding="max_length"

    def __call__(self, text, padding=None, max_length=None, return_tensors="pt", **kwargs):
        from transformers import BatchEncoding

        batch = 1 if isinstance(text, str) else len(text)
        n = max_length if padding == "max_length" and max_length else self.length
        ids = torch.ones(batch, n, dtype=torch.long)
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def batch_decode(self, ids, **kwargs) -> list[str]:
        return [""] * len(ids)

    def apply_chat_template(self, conversations, tokenize=False, padding=None, max_length=None, **kwargs):
        """A chat-formatted prompt's ids as __call__ gives them (a pipeline that formats its
        prompt as a conversation: HunyuanVideo-1.5's Qwen)."""
        batch = len(conversations) if conversations and isinstance(conversations[0], list) else 1
        if not tokenize:
            return [""] * batch
        return self([""] * batch, padding=padding, max_length=max_length)


def cast_like_loader(module, dtype: torch.dtype) -> None:
    """`module` in `dtype` as from_pretrained leaves it: diffusers keeps the parameters of its
    `_keep_in_fp32_modules` in float32 (any dtype), transformers only under float16; buffers
    (rotary tables) stay as the class made them."""
    from diffusers import ModelMixin

    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    if not isinstance(module, ModelMixin) and dtype != torch.float16:
        keep = set()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.is_floating_point():
                continue
            want = torch.float32 if keep & set(name.split(".")) else dtype
            if param.dtype != want:
                param.data = param.data.to(want)


def _read_config(file: Path) -> dict:
    try:
        return read_json_file(file, "model file")
    except FileNotFoundError:
        raise ConfigError(f"cannot read {file}: no such file") from None


def _transformers_model(class_name: str, config: dict):
    """A transformers model from a config.json's keys (its `model_type` names the config class)."""
    import transformers

    keys = {
        k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype", "dtype")
    }
    model_type = keys.pop("model_type", None)
    if model_type is None or not hasattr(transformers, class_name):
        raise ConfigError(f"cannot build a {class_name} from its config (no model_type, or an unknown class)")
    return getattr(transformers, class_name)(transformers.AutoConfig.for_model(model_type, **keys))


def _named_configs(spec: ModelSpec) -> dict:
    """{component: (class name, config)} of a registry model (its family's other components)."""
    named = spec.named
    return FAMILIES[spec.family].named_parts(named.transformer, named.vae, spec.variant)


def _dir_configs(path: Path) -> dict:
    """{component: (class name, config)} of a diffusers directory (model_index.json): each
    component's config file is the one its class saves (`config_name`: config.json for a model,
    scheduler_config.json, a guider's); tokenizers and processors (feature extractors) are stood in for."""
    try:
        index = read_json_file(path / "model_index.json", "model file")
    except FileNotFoundError:
        raise ConfigError(f"cannot read {path / 'model_index.json'}: no such file") from None
    parts = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[1] is None:
            continue
        if name.startswith("tokenizer") or name.endswith(("processor", "feature_extractor")):
            continue
        file = path / name / (getattr(find_class(entry[1]), "config_name", None) or "config.json")
        parts[name] = (entry[1], _read_config(file))
    return parts


def _parts(spec: ModelSpec, path: Path | None) -> dict:
    """{component: (class name, config)}: `path`'s, else a registry name's built-in configs."""
    if path is None and spec.builtin:
        path = registry.BUILTIN_DIR
    return _dir_configs(path) if path is not None else _named_configs(spec)


def meta_scheduler(spec: ModelSpec, path: Path | None):
    """The model's scheduler, from its config (nothing else built)."""
    class_name, config = _parts(spec, path)["scheduler"]
    return find_class(class_name).from_config({k: v for k, v in config.items() if k != "_class_name"})


def meta_components(spec: ModelSpec, path: Path | None, dtype: torch.dtype, max_text_len: int) -> dict:
    """The components `load_components` returns, on the meta device: transformers and text
    encoders in `dtype` (their float32 modules kept), the VAE and the CLIP image encoder in
    float32. `path` None: a registry name's built-in configs."""
    from diffusers.configuration_utils import ConfigMixin

    components: dict = {}
    for name, (class_name, config) in _parts(spec, path).items():
        cls = find_class(class_name)
        settings = {k: v for k, v in config.items() if not k.startswith("_")}
        if cls is not None and not issubclass(cls, torch.nn.Module):  # a scheduler, a guider: its settings
            components[name] = cls.from_config(settings)
            continue
        with torch.device("meta"):
            if isinstance(cls, type) and issubclass(cls, ConfigMixin):  # diffusers', or a family's own
                module = cls.from_config(settings)
            else:
                module = _transformers_model(class_name, config)
        want = torch.float32 if name in ("vae", "image_encoder") else dtype
        cast_like_loader(module, want)
        components[name] = module.eval().requires_grad_(False)
    for name in [n for n in components if n.startswith("text_encoder")]:  # each encoder's own tokenizer
        components[name.replace("text_encoder", "tokenizer")] = ShapeTokenizer()
    if "image_encoder" in components:
        components.update(_image_processor(components["image_encoder"]))
    return components


def _image_processor(encoder) -> dict:
    """A stand-in processor for `encoder`, under the name its pipeline reads: SigLIP's (HunyuanVideo-
    1.5's `feature_extractor`) at the encoder's own input size, else CLIP's (`image_processor`)."""
    import transformers

    if type(encoder).__name__ == "SiglipVisionModel":  # transformers 5 names its PIL processor so
        siglip = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
        size = encoder.config.image_size
        return {"feature_extractor": siglip(size={"height": size, "width": size})}
    return {"image_processor": transformers.CLIPImageProcessor()}


def meta_transformers(spec: ModelSpec, path: Path | None) -> dict:
    """{"transformer"[, "transformer_2"]: the module on the meta device}: what a LoRA is checked
    against before anything is loaded (runtime/models/adapters.py)."""
    built = {}
    for name, (class_name, config) in _parts(spec, path).items():
        if name.startswith("transformer"):
            with torch.device("meta"):
                built[name] = find_class(class_name).from_config(
                    {k: v for k, v in config.items() if not k.startswith("_")}
                )
    return built


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give a meta module uninitialised tensors on `device` (under FakeTensorMode: fake ones),
    keeping tied parameters tied (`to_empty` cannot swap a parameter two modules hold)."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = torch.nn.Parameter(empty, requires_grad=False) if table is sub._parameters else empty
                table[name] = made[id(t)]
