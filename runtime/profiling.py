"""`--profile`: where a rank's denoising time goes, by category, and a trace to look at.

Each rank runs torch.profiler over an item's denoising steps (all but the first, which pays
for lazy set-up: the communicators' first use, the allocator's first blocks; the only one
when the item has one step) and writes a Chrome trace (`OUT/profile/ID.rankR.json.gz`, for
Perfetto or chrome://tracing). Every operator's own time (its self time: without the
operators it called) is put in one category:

- inside a `region` of the runtime (`ditango::<name>`, the nearest one around it): that
  region's category. The runtime marks the attention kernel, the state merge, the exchanges
  (posting them and waiting for them) and DiTango's cache and planner statistics, and the
  families mark their rotary embedding;
- else by the outermost operator of its call chain that names one (`aten::linear` -> its
  `aten::addmm` is linear too): linear, norms, copies, exchange (collectives run outside a
  region), attention;
- else "other ops" (elementwise activations, modulation, the scheduler).

"outside ops" is the time between operators on the denoising thread (Python, the host work
of each layer, waits not inside an operator). On CUDA the kernels' device time is put in
the category of the operator that launched them, and "device idle" is the wall time the
GPU spent in none. Times are per profiled step, in milliseconds.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REGION_PREFIX = "ditango::"
SPAN = REGION_PREFIX + "profiled"  # the whole profiled window, on the denoising thread
STEP = REGION_PREFIX + "step "  # one denoising step (a marker for the trace: its own time is outside ops)
# The runtime's regions (`region`'s names); each is its own category.
REGIONS = ("attention", "merge", "exchange", "bookkeeping", "rotary")
# An operator's category: its exact name, else the first pattern in its (lower-case) name.
OP_NAMES = {
    "linear": ("aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::baddbmm",
               "aten::_scaled_mm", "aten::convolution"),
    "copies": ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone", "aten::cat",
               "aten::stack", "aten::index", "aten::narrow_copy", "aten::_reshape_copy"),
}  # fmt: skip
OP_PATTERNS = (
    ("attention", ("scaled_dot_product", "flash_attn", "_flash_attention", "_efficient_attention")),
    ("norms", ("layer_norm", "rms_norm", "group_norm", "batch_norm")),
    ("exchange", ("gloo:", "nccl:", "c10d::", "record_param_comms")),
)
OP_CATEGORY = {name: category for category, names in OP_NAMES.items() for name in names}
CATEGORIES = (*REGIONS, "linear", "norms", "copies", "other ops", "outside ops")


def _span(label: str):
    """A span named `label` in a profile; nothing when no profiler runs, nor inside a compiled
    block (asking whether a profiler runs would break its graph; its ops are profiled anyway)."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return record_function(label)


def region(name: str):
    """A named span of the runtime (`name` in REGIONS)."""
    return _span(REGION_PREFIX + name)


def step_region(step: int):
    """A denoising step's span (`ditango::step N`)."""
    return _span(f"{STEP}{step}")


def op_category(name: str) -> str | None:
    if name in OP_CATEGORY:
        return OP_CATEGORY[name]
    lowered = name.lower()
    for category, patterns in OP_PATTERNS:
        if any(p in lowered for p in patterns):
            return category
    return None


def category_of(event) -> str:
    """The category of a profiler event's own time (see the module's docstring)."""
    chain = []
    e = event
    while e is not None and e.name != SPAN:
        if not e.name.startswith(STEP):
            chain.append(e)
        elif e is event:
            return "outside ops"
        e = e.cpu_parent
    for e in chain:  # the nearest region
        if e.name.startswith(REGION_PREFIX):
            name = e.name[len(REGION_PREFIX) :]
            return name if name in REGIONS else "other ops"
    for e in reversed(chain):  # the outermost operator that names a category
        if (category := op_category(e.name)) is not None:
            return category
    return "other ops"


def table(events, steps: int) -> dict:
    """{"wall_ms", "cpu_ms": {category: ms}, "device_ms": {...} (CUDA only)}, per step, from
    the profiler's events (`prof.events()`) of one profiled window."""
    span = next(e for e in events if e.name == SPAN)
    cpu: dict[str, float] = defaultdict(float)
    device: dict[str, float] = defaultdict(float)
    for e in events:
        if e.thread != span.thread or e is span or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if not (span.time_range.start <= e.time_range.start and e.time_range.end <= span.time_range.end):
            continue
        category = category_of(e)
        cpu[category] += e.self_cpu_time_total
        device[category] += getattr(e, "self_device_time_total", 0.0)
    cpu["outside ops"] += span.self_cpu_time_total
    wall_us = span.time_range.elapsed_us()
    per_step = 1e-3 / steps  # us -> ms per step
    out = {"wall_ms": round(wall_us * per_step, 3), "cpu_ms": {c: round(cpu[c] * per_step, 3) for c in CATEGORIES}}
    if sum(device.values()) > 0:
        device_ms = {c: round(device[c] * per_step, 3) for c in CATEGORIES if c != "outside ops"}
        device_ms["device idle"] = round(max(0.0, wall_us - sum(device.values())) * per_step, 3)
        out["device_ms"] = device_ms
    return out


def trace_name(item_id: str, rank: int) -> str:
    """A rank's trace of an item, relative to the output folder."""
    return f"profile/{item_id}.rank{rank}.json.gz"


class StepProfiler:
    """Profiles a rank's denoising of one item: the loop's `on_step` goes through `observing`
    (the profiler starts once the first step is over), `finish` after the last step (the
    table, and the trace written to `trace`); `abandon` when the denoising failed."""

    def __init__(self, device: torch.device, steps: int, trace: Path) -> None:
        self.device, self.trace = device, trace
        self.skipped = 1 if steps > 1 else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile = profile(activities=activities)
        self._span = None
        if not self.skipped:
            self._start()

    def _start(self) -> None:
        self._profile.start()
        self._span = record_function(SPAN)
        self._span.__enter__()

    def observing(self, on_step: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """The denoising loop's `on_step` that calls `on_step`, then starts the profiler after the first step."""

        def step_done(done: int, steps: int) -> None:
            on_step(done, steps)
            if self._span is None and done == self.skipped:
                self._start()

        return step_done

    def finish(self, steps_run: int) -> dict | None:
        """The rank's table over the profiled steps (None when none ran), after the trace is written."""
        if self._span is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._span.__exit__(None, None, None)
        self._profile.stop()
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.trace))
        profiled = steps_run - self.skipped
        return {"steps": profiled, **table(self._profile.events(), profiled)} if profiled > 0 else None

    def abandon(self) -> None:
        """Stop without a table (the item failed)."""
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._profile.stop()
            self._span = None


def summary(records: list[dict]) -> dict | None:
    """report.json's `profile`: per rank, each category's ms per step averaged over the items
    profiled (weighted by their profiled steps); None when no item was."""
    tables = [r["profile"] for r in records if r.get("profile")]
    if not tables:
        return None
    ranks = max(len(t["per_rank"]) for t in tables)
    per_rank = []
    for rank in range(ranks):
        rows = [t["per_rank"][rank] for t in tables if rank < len(t["per_rank"]) and t["per_rank"][rank]]
        steps = sum(row["steps"] for row in rows)
        if not steps:
            per_rank.append(None)
            continue
        merged = {"steps": steps, "wall_ms": round(sum(row["wall_ms"] * row["steps"] for row in rows) / steps, 3)}
        for key in ("cpu_ms", "device_ms"):
            if all(key in row for row in rows):
                names = rows[0][key]
                merged[key] = {c: round(sum(row[key][c] * row["steps"] for row in rows) / steps, 3) for c in names}
        per_rank.append(merged)
    return {"items": len(tables), "per_rank": per_rank}
