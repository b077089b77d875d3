"""Model families: the adapter module of each transformer class the runtime parallelizes.

An adapter (runtime/models/wan.py is the model) provides `install(transformer, ctx)` and
`uninstall(...)`, `attention_shape(transformer)` and `patch_size(transformer)`. A new family
is one adapter module and one line here.
"""

from __future__ import annotations

from types import ModuleType

from runtime.models import hunyuan, wan

ADAPTERS: dict[str, ModuleType] = {wan.TRANSFORMER_CLASS: wan, hunyuan.TRANSFORMER_CLASS: hunyuan}


def adapter_for(transformer) -> ModuleType:
    name = type(transformer).__name__
    if name not in ADAPTERS:
        raise TypeError(f"no model adapter for {name}; known: {', '.join(ADAPTERS)}")
    return ADAPTERS[name]
