"""DiTango's runtime (planner/strategies/ditango.py): the selective attention of
runtime/strategies/selective.py, sized for the transformers it serves."""

from __future__ import annotations

from planner.ditango import DiTangoOptions
from runtime.cache import CACHE_DTYPES
from runtime.models.families import family_of
from runtime.strategies.selective import SelectiveRuntime


def build(ctx, transformers, options: DiTangoOptions | None) -> SelectiveRuntime:
    """One runtime for every transformer (experts take turns: one attention shape and patch)."""
    opts = options or DiTangoOptions()
    family, first = family_of(transformers[0]), transformers[0]
    layers, heads, head_dim = family.attention_shape(first)
    return SelectiveRuntime(
        ctx.mesh,
        ctx.comm,
        ctx.backend,
        opts.planner,
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        cache_dtype=None if opts.cache_dtype is None else CACHE_DTYPES[opts.cache_dtype],
        cache_limit_bytes=opts.cache_limit_bytes,
        patch=family.patch_size(first),
        element_bytes=next(first.parameters()).element_size(),
    )
