"""The memory pre-flight: the options under which an item fits a GPU (offloading only where
needed), and when nothing given does, the fewest options and GPUs that would make it fit,
tried on the memory model (planner/memory.py)."""

from __future__ import annotations

from dataclasses import replace

from basics.errors import ConfigError
from planner.layout import ParallelLayout
from planner.memory import GIB, HEADROOM_BYTES, HEADROOM_FRACTION, MemoryOptions, estimate_memory
from planner.models import VideoSize
from planner.strategy import DEFAULT_CP

MAX_SUGGESTED_GPUS = 64
GPUS_PER_NODE_MAX = 8  # more ranks fill a node to this before adding nodes


def usable_bytes(gpu_memory_bytes: int) -> int:
    """What of a GPU's memory the allocator's peak may reach (see HEADROOM_*)."""
    return int(gpu_memory_bytes * (1 - HEADROOM_FRACTION)) - HEADROOM_BYTES


def fit_to_memory(shape, layout, size: VideoSize, options, gpu_memory_bytes) -> MemoryOptions:
    """`options` with offload_text_encoder / offload_transformer turned on only where needed to
    fit (the runtime offloads only when memory is short): the first of none, the encoders, the
    transformer, both that fits; both when none does. Unchanged when everything fits."""
    usable = usable_bytes(gpu_memory_bytes)
    tries = [options] + [
        replace(
            options,
            offload_text_encoder=t or options.offload_text_encoder,
            offload_transformer=m or options.offload_transformer,
        )
        for t, m in ((True, False), (False, True), (True, True))
    ]
    for o in tries:
        if estimate_memory(shape, layout, size, o).peak_bytes <= usable:
            return o
    return tries[-1]


def scaled_layout(layout: ParallelLayout, factor: int, heads: int) -> ParallelLayout:
    """`layout` on `factor` x its ranks: GPUs per node doubled up to GPUS_PER_NODE_MAX, then nodes."""
    nodes, gpus = layout.nodes, layout.gpus_per_node
    while factor > 1:
        if gpus * 2 <= max(GPUS_PER_NODE_MAX, layout.gpus_per_node):
            gpus *= 2
        else:
            nodes *= 2
        factor //= 2
    strategy = layout.strategy if layout.strategy.runtime is not None else DEFAULT_CP
    cp = nodes * gpus // layout.cfg_degree
    group = layout.group_size if layout.group_size and cp % layout.group_size == 0 else None
    scaled = ParallelLayout(nodes, gpus, layout.cfg_degree, strategy, None, group).with_defaults(heads)
    scaled.check_model(heads)
    return scaled


def _fixes(layout: ParallelLayout, o: MemoryOptions) -> list[tuple[str, dict]]:
    """The options that can lower the peak, as (flag, options change)."""
    fixes = []
    if not o.shard_weights and not o.hybrid and layout.cp_degree > 1 and not layout.strategy.splits_weights:
        fixes.append(("--shard-weights", {"shard_weights": True}))
    if not o.vae_parallel and layout.world_size > 1:
        fixes.append(("--vae-parallel", {"vae_parallel": True}))
    elif not o.vae_tiling and not o.vae_parallel:
        fixes.append(("--vae-tiling", {"vae_tiling": True}))
    if layout.strategy.reuses and o.cache_bytes == 4:
        fixes.append(("--cache-dtype bfloat16", {"cache_bytes": 2}))
    return fixes


def find_fix(shape, layout, size: VideoSize, options, gpu_memory_bytes) -> str | None:
    """The fewest options, on the fewest ranks (doubling), that make the item fit; None if
    nothing up to MAX_SUGGESTED_GPUS does."""
    usable, factor = usable_bytes(gpu_memory_bytes), 1
    while layout.world_size * factor <= MAX_SUGGESTED_GPUS:
        try:
            big = layout if factor == 1 else scaled_layout(layout, factor, shape.heads)
        except (ConfigError, ValueError):
            factor *= 2
            continue
        fixes = _fixes(big, options)
        subsets = sorted(range(1 << len(fixes)), key=lambda m: (bin(m).count("1"), m))
        for mask in subsets:
            chosen = [fixes[i] for i in range(len(fixes)) if mask >> i & 1]
            if factor == 1 and not chosen:
                continue  # the caller's own options: known not to fit
            o = replace(options, **{k: v for _, change in chosen for k, v in change.items()})
            o = fit_to_memory(shape, big, size, o, gpu_memory_bytes)
            if estimate_memory(shape, big, size, o).peak_bytes <= usable:
                words = [flag for flag, _ in chosen]
                if factor > 1:
                    where = f"--gpus-per-node {big.gpus_per_node}"
                    if big.nodes != layout.nodes:
                        where = f"--nodes {big.nodes} {where}"
                    words.append(f"{big.world_size} GPUs ({where})")
                return " and ".join(words)
        factor *= 2
    return None


def preflight(shape, layout, size: VideoSize, options, gpu_memory_bytes, what: str) -> MemoryOptions:
    """`fit_to_memory`, and when even that does not fit raise a one-line ConfigError: the
    predicted peak (GiB, phase) against the GPU's memory and the options that would make it
    fit, found by trying them on the model. Returns the fitted options otherwise."""
    fitted = fit_to_memory(shape, layout, size, options, gpu_memory_bytes)
    est = estimate_memory(shape, layout, size, fitted)
    usable = usable_bytes(gpu_memory_bytes)
    if est.peak_bytes <= usable:
        return fitted
    fix = find_fix(shape, layout, size, options, gpu_memory_bytes)
    # what neither sharding nor offloading shrinks: the text encoders' embeddings and CLIP, the image encoder, the VAE
    unshrunk = shape.text_encoder_root_params + shape.text_encoder_whole_params
    floor = unshrunk * options.dtype_bytes + est.stages["image_encoder"] + est.stages["vae_weights"]
    if fix:
        advice = f"fits with {fix}"
    elif floor > usable:
        advice = f"no option makes it fit: the encoders' embeddings and the VAE alone need {floor / GIB:.1f} GiB"
    else:
        advice = f"nothing up to {MAX_SUGGESTED_GPUS} GPUs fits: lower --height/--width/--frames"
    offloaded = ""
    if est.peak_stage != "text_encode" and (fitted.offload_text_encoder or fitted.offload_transformer):
        offloaded = (
            " with "
            + " and ".join(
                n
                for n, on in (
                    ("the encoders", fitted.offload_text_encoder),
                    ("the transformer", fitted.offload_transformer),
                )
                if on
            )
            + " offloaded"
        )
    raise ConfigError(
        f"{what} needs {est.peak_bytes / GIB:.1f} GiB per GPU at its peak ({est.peak_stage}, mostly "
        f"{est.peak_component.replace('_', ' ')}){offloaded}, the GPU has {gpu_memory_bytes / GIB:.1f} GiB "
        f"({usable / GIB:.1f} GiB usable); {advice}"
    )
