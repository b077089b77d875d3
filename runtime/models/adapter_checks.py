"""Whether a LoRA file fits the model it is applied to: read before anything is loaded, so a
LoRA of another model, a damaged file or a config its tensors contradict is refused in one
line (naming the adapter and the layer) rather than failing inside peft or giving a wrong
video."""

from __future__ import annotations

import math
import re

from basics.errors import ConfigError

# The tensors of one adapted linear layer, as diffusers names them after its conversions.
FACTORS = ("A.weight", "B.weight", "B.bias")


def check_against(adapter, state: dict, transformer, where: str = "--lora", metadata=None) -> None:
    """Refuse, in one line, a LoRA that does not fit `transformer` (a model on any device, the
    meta one included) or could not be applied: keys of no linear layer of it, factors that
    are not matrices of finite floating-point numbers, of other sizes than its layers', or
    whose ranks differ (lora_B @ lora_A would not multiply) or are 0; or a peft config in its
    file (`metadata`) that its tensors do not match."""
    modules = dict(transformer.named_modules())
    factors: dict[str, dict] = {}  # module name -> {factor: tensor}
    said = f"{where} {adapter.source}"
    for key, tensor in state.items():
        name, _, rest = key.removeprefix("transformer.").rpartition(".lora_")
        if rest not in FACTORS:
            raise ConfigError(f"{said}: {key!r} is not a LoRA key (module.lora_A/B.weight)")
        module = modules.get(name)
        if module is None or not hasattr(module, "in_features"):
            raise ConfigError(
                f"{said}: it adapts {name!r}, which the model has no linear layer of (a LoRA of another model?)"
            )
        if not tensor.is_floating_point():
            raise ConfigError(
                f"{said}: {name} lora_{rest} holds {str(tensor.dtype).removeprefix('torch.')} "
                "numbers; a LoRA's are floating point"
            )
        if not bool(tensor.float().isfinite().all()):  # float8 has no isfinite of its own
            raise ConfigError(f"{said}: {name} lora_{rest} holds non-finite values (nan or inf)")
        factors.setdefault(name, {})[rest] = tensor
    if not factors:
        raise ConfigError(f"{said}: no LoRA weights for the transformer in it")
    for name, parts in factors.items():
        a, b, bias = parts.get("A.weight"), parts.get("B.weight"), parts.get("B.bias")
        if a is None or b is None:
            have, lack = ("B", "A") if a is None else ("A", "B")
            raise ConfigError(f"{said}: {name} has a lora_{have} and no lora_{lack}")
        for factor, tensor in (("A", a), ("B", b)):
            if tensor.ndim != 2:
                raise ConfigError(
                    f"{said}: {name} lora_{factor} is {tensor.ndim}-D {tuple(tensor.shape)}; a LoRA "
                    "factor of a linear layer is a matrix"
                )
        module = modules[name]
        if a.shape[1] != module.in_features:
            raise ConfigError(
                f"{said}: {name} takes {module.in_features} inputs, its lora_A {tuple(a.shape)} (a LoRA "
                "of another model size?)"
            )
        if b.shape[0] != module.out_features:
            raise ConfigError(
                f"{said}: {name} gives {module.out_features} outputs, its lora_B {tuple(b.shape)} (a "
                "LoRA of another model size?)"
            )
        if a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise ConfigError(
                f"{said}: {name} lora_A has rank {a.shape[0]}, its lora_B rank {b.shape[1]}: the "
                "factors do not multiply" + (" to a LoRA (rank 0)" if a.shape[0] == b.shape[1] else "")
            )
        if bias is not None and tuple(bias.shape) != (module.out_features,):
            raise ConfigError(
                f"{said}: {name} lora_B bias {tuple(bias.shape)} is not one value per output ({module.out_features})"
            )
    check_metadata(said, metadata, factors)


def check_metadata(said: str, metadata, factors: dict[str, dict]) -> None:
    """diffusers makes an adapter's peft config from the `lora_adapter_metadata` its file carries,
    as it is, not from its tensors (diffusers.utils.peft_utils `_create_lora_config`): a config
    peft refuses, ranks that are not the tensors', or targets that leave out a layer the file
    has weights for would fail at load or leave that layer's weights unused."""
    if metadata is None:
        return
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if isinstance(metadata, dict):  # the transformer's keys, as diffusers' load_lora_adapter takes them
        metadata = {k.removeprefix("transformer."): v for k, v in metadata.items() if k.startswith("transformer.")}
    try:
        config = LoraConfig(**metadata) if isinstance(metadata, dict) else None
    except Exception as exc:  # peft's own checks: TypeError, ValueError
        config, why = None, (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    else:
        why = "not a JSON object" if config is None else ""
    if config is None:
        raise ConfigError(f"{said}: its lora_adapter_metadata is no peft LoRA config ({why})")
    ranks = {"r": config.r, **{f"rank_pattern {k}": v for k, v in (config.rank_pattern or {}).items()}}
    alphas = {
        "lora_alpha": config.lora_alpha,
        **{f"alpha_pattern {k}": v for k, v in (config.alpha_pattern or {}).items()},
    }
    for key, value in ranks.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{said}: its lora_adapter_metadata's {key} must be a positive integer, got {value!r}")
    for key, value in alphas.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{said}: its lora_adapter_metadata's {key} must be a finite number, got {value!r}")
    for name, parts in factors.items():
        pattern = next((k for k in config.rank_pattern or {} if re.match(rf"(.*\.)?({k})$", name)), None)
        want = config.rank_pattern[pattern] if pattern is not None else config.r
        have = parts["A.weight"].shape[0]  # both factors there, of one rank (check_against)
        if have != want:
            raise ConfigError(f"{said}: {name} has rank {have}, its lora_adapter_metadata says {want}")
        if not check_target_module_exists(config, name):
            raise ConfigError(
                f"{said}: its lora_adapter_metadata's target_modules leave out {name}, which it has weights for"
            )
