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
    # By the class or a base of it: FSDP2 (--shard-weights) makes an FSDP<Name> subclass.
    for cls in type(transformer).__mro__:
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__]
    raise TypeError(f"no model adapter for {type(transformer).__name__}; known: {', '.join(ADAPTERS)}")
