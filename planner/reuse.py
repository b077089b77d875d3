"""Whether DiTango's reuse pays on a run: the attention it saves against its bookkeeping.

Reusing a unit's cached state saves that unit's attention (its kernel, and the part of its
KV fetch the kernel does not hide) but costs bookkeeping the exact ring does not do: per
layer of a selective step the planner's statistics on the local state, each reused unit's
cached state read back (and widened to float32 when the cache holds bfloat16), and each
computed unit's state written to the cache. The statistics are memory-bound passes and a
dozen small kernels, so where the attention of a unit is short (few tokens per rank, a fast
GPU) they can cost more than the reuse saves, and DiTango would be slower than the ring it
replaces.

`reuse_costs` prices both, per layer and CFG branch of a selective step at the run's cache
ratio, on the hardware profile of the run's device (planner/cost_model.py; `CPU` for CPU
runs). The runtime (runtime/strategies/selective.py) asks it once per item: where the
reuse does not pay, the item runs the exact ring over the cp group (every step exact), and
the report says so with both numbers.

docs/ALGORITHMS.md 2.4 says why. Shape legend: S the largest local chunk (query tokens per rank), H heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.cost_model import ASSUMPTIONS, HARDWARE, Hardware
from planner.layout import ParallelLayout, chunk_sizes
from planner.schedule import PlannerConfig
from planner.strategies.ditango import ditango_attention_time
from planner.traffic import Topology, unit_fractions

# The balance of a CPU run (a few cores and their memory): what the rule prices there. Never a
# layout's hardware (simulate and --layout auto price GPUs).
CPU = Hardware("cpu", 0.2, 0.02, 5.0, 5.0, 50.0, "a few CPU cores: ~0.2 TFLOPS float32, ~20 GB/s memory")
FALLBACK_GPU = "h20"  # a GPU whose name no profile matches: the slowest profile (reuse saves most there)


def device_hardware(device_type: str, device_name: str = "") -> Hardware:
    """The profile of a run's device: a GPU's by its name (torch.cuda.get_device_name), else `CPU`."""
    if device_type != "cuda":
        return CPU
    name = device_name.lower().replace(" ", "")
    return HARDWARE[next((k for k in sorted(HARDWARE, key=len, reverse=True) if k in name), FALLBACK_GPU)]


# What a planner's statistics and the cache cost per layer of a selective step, in passes over
# one unit's float32 state [S, H, D] and in kernels (planner/hpdc.py, planner/budget.py `measure`).
BOOKKEEPING = {
    # C = mean_D(local out) (one pass), drift and gate over [S, H]: ~12 kernels, ~3 more per unit.
    "hpdc": {"fixed_passes": 1.0, "computed_passes": 0.0, "fixed_kernels": 12, "unit_kernels": 3},
    # the same, and per recomputed unit its error had it been reused (old and new state, weighted).
    "budget": {"fixed_passes": 1.0, "computed_passes": 3.0, "fixed_kernels": 12, "unit_kernels": 6},
}


@dataclass(frozen=True)
class ReuseCosts:
    """Per layer and branch of a selective step, in seconds."""

    saved_s: float  # the attention (and exposed fetch) of the units reused
    bookkeeping_s: float  # statistics, cache reads and writes
    hardware: str

    @property
    def pays(self) -> bool:
        return self.saved_s > self.bookkeeping_s

    def to_json(self) -> dict:
        return {
            "pays": self.pays,
            "saved_us_per_layer": round(self.saved_s * 1e6, 3),
            "bookkeeping_us_per_layer": round(self.bookkeeping_s * 1e6, 3),
            "hardware": self.hardware,
        }


def reuse_costs(
    hw: Hardware,
    layout: ParallelLayout,
    heads: int,
    head_dim: int,
    tokens: int,
    *,
    cache_ratio: float,
    planner: str = "hpdc",
    own_group: str = "decide",
    element_bytes: int = 2,
    cache_bytes: int = 2,
) -> ReuseCosts:
    """What reuse at `cache_ratio` (the share of cells a selective step reuses) saves and costs
    on `layout` for a video of `tokens` tokens. `element_bytes`: the transformer's dtype (its KV
    travels in it); `cache_bytes`: the cache's `out` dtype (the state is float32 elsewhere)."""
    topo = Topology(layout)
    sizes = chunk_sizes(tokens, layout.cp_degree)
    S = max(sizes)
    every = ditango_attention_time(
        hw, topo, heads, head_dim, sizes, element_bytes, unit_fractions(1.0, layout, own_group), own_group
    )
    selective = ditango_attention_time(
        hw, topo, heads, head_dim, sizes, element_bytes, unit_fractions(1.0 - cache_ratio, layout, own_group), own_group
    )
    units = len(unit_fractions(1.0, layout, own_group))
    kernels = BOOKKEEPING[planner]
    state = S * heads * head_dim * 4  # one float32 state's out
    lse = S * heads * 4
    reused, computed = cache_ratio * units, (1.0 - cache_ratio) * units
    widen = 0 if cache_bytes == 4 else state + state * cache_bytes // 4  # read the cache, write float32
    put = state * cache_bytes // 4 + state + 2 * lse  # read the state, write the cache
    passes = kernels["fixed_passes"] * state + computed * (put + kernels["computed_passes"] * state)
    moved = passes + reused * widen + units * 4 * lse  # the drift terms read [S, H] per unit
    launches = kernels["fixed_kernels"] + units * kernels["unit_kernels"] + reused * (widen > 0) + 2 * computed
    bookkeeping = moved / (hw.hbm_tbps * 1e12) + launches * ASSUMPTIONS["kernel_overhead_us"] * 1e-6
    # A reused unit also spares its kernel's launch.
    saved = every - selective + reused * ASSUMPTIONS["kernel_overhead_us"] * 1e-6
    return ReuseCosts(saved, bookkeeping, hw.name)


def run_reuse_costs(
    device: torch.device,
    layout: ParallelLayout,
    heads: int,
    head_dim: int,
    tokens: int,
    cfg: PlannerConfig,
    element_bytes: int,
    cache_bytes: int,
) -> ReuseCosts:
    """`reuse_costs` of a run's planner config on the profile of the device it runs on."""
    # A rehearsal's CUDA tensors are fake: no GPU to name (FALLBACK_GPU's profile then).
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else ""
    return reuse_costs(
        device_hardware(device.type, name),
        layout,
        heads,
        head_dim,
        tokens,
        cache_ratio=cfg.cache_ratio,
        planner=cfg.planner,
        own_group=cfg.own_group,
        element_bytes=element_bytes,
        cache_bytes=cache_bytes,
    )
