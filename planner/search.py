"""The layout search behind `--layout auto` and `ditango simulate --batch`: every legal way
to run a model on nodes x GPUs (independent replicas, CFG over two rank groups, ring, Ulysses,
USP at each Ulysses degree, TP, DiTango at each group size, weights sharded or not), priced by
the cost model (planner/cost_model.py) and the memory model (planner/memory.py), the layouts
that do not fit dropped, the rest ranked by an objective:

- `throughput`: videos per hour for a batch, each item priced on the layout (its denoising and
  its decode): with the shared queue (`queue="shared"`), every replica of every worker pulls
  the next item, longest first (planner/batch.py `lpt_makespan`); with the static split
  (`"static"`), replicas work in rounds of the largest item, so a last round with idle
  replicas is paid in full;
- `latency`: one video's end-to-end time (the problem's own size: the batch's largest).

Exact layouts only unless reuse is allowed: an automatic choice never makes videos lossy
behind the user's back. Times are the cost model's (denoising, with per-block launch
overheads) plus the decode's, from the VAE's convolution FLOPs; text encoding and loading are
the same for every layout and left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from basics.errors import ConfigError
from planner.batch import lpt_makespan, round_robin_makespan
from planner.cost_model import ASSUMPTIONS, Hardware, estimate
from planner.decode_memory import chunks, level_frames, output_frames, tile_grid
from planner.layout import ParallelLayout, replica_shape
from planner.memory import MemoryOptions, cfg_branches, estimate_memory
from planner.models import ModelShape, VideoSize
from planner.plan_shape import PlanReplay, PlanSource
from planner.precision import ATTENTION, check_fp8_hardware, check_quantize
from planner.preflight import fit_to_memory, usable_bytes
from planner.strategy import STRATEGIES

OBJECTIVES = ("throughput", "latency")
QUEUES = ("shared", "static")  # every replica pulls the next item, longest first; or item i to replica i % R
TIE = 0.01  # layouts within 1% of the best by the objective rank as equals (see `rank`)
CONVS_PER_LEVEL = 7  # a video VAE's decoder: 3 residual blocks of 2 convolutions and an upsampler a resolution
VAE_EFFICIENCY = 0.2  # float32 3-D convolutions (TF32 at best): achieved / bf16 peak
TILE_OVERLAP = (4 / 3) ** 2  # diffusers' tiles overlap a quarter on each side: a tiled decode's extra work


@dataclass
class Choice:
    """One way to run: `replicas` copies of `layout`, with its priced time and memory."""

    replicas: int
    layout: ParallelLayout
    shard_weights: bool = False
    denoise_s: float = 0.0
    decode_s: float = 0.0
    overhead_s: float = 0.0
    peak_memory_bytes: int = 0
    inter_node_bytes: int = 0  # one video's
    intra_node_bytes: int = 0
    offload: list[str] = field(default_factory=list)
    batch_s: float = 0.0  # the batch by the problem's queue
    round_robin_s: float = 0.0  # the same items split statically, item i to worker i % workers
    videos_per_hour: float = 0.0

    @property
    def e2e_s(self) -> float:
        return self.denoise_s + self.decode_s + self.overhead_s

    @property
    def label(self) -> str:
        lay = self.layout
        text = lay.strategy.label(lay) if lay.cp_degree > 1 or lay.strategy.runtime is None else "one GPU a branch"
        text += ", cfg-parallel" if lay.cfg_degree == 2 else ""
        text += ", sharded" if self.shard_weights else ""
        gpus = lay.world_size
        return f"{self.replicas} x [{text}]" + (f" ({gpus} GPUs each)" if self.replicas > 1 and gpus > 1 else "")

    def flags(self) -> list[str]:
        """The options of `generate` that give this layout."""
        lay, out = self.layout, []
        if self.replicas > 1:
            out += ["--replicas", str(self.replicas)]
        if lay.cp_degree > 1:
            out += lay.strategy.flags(lay)
        if lay.cfg_degree == 2:
            out.append("--cfg-parallel")
        if self.shard_weights:
            out.append("--shard-weights")
        return out

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "replicas": self.replicas,
            "layout": self.layout.to_json(),
            "shard_weights": self.shard_weights,
            "flags": self.flags(),
            "videos_per_hour": round(self.videos_per_hour, 2),
            "e2e_s": round(self.e2e_s, 6),
            "denoise_s": round(self.denoise_s, 6),
            "decode_s": round(self.decode_s, 6),
            "overhead_s": round(self.overhead_s, 6),
            "batch_s": round(self.batch_s, 4),
            "round_robin_s": round(self.round_robin_s, 4),
            "peak_memory_bytes": self.peak_memory_bytes,
            "inter_node_bytes": self.inter_node_bytes,
            "intra_node_bytes": self.intra_node_bytes,
            "offload": self.offload,
        }


@dataclass(frozen=True)
class Problem:
    """What the search is asked: the model, one video's size and steps (the batch's largest: its
    memory is checked), the cluster, the batch: `mix`, its items as (size, steps, CFG scale), or
    `batch` copies of the problem's own; `workers` copies of the allocation (array tasks) share
    the `queue`."""

    shape: ModelShape
    size: VideoSize
    steps: int
    nodes: int
    gpus_per_node: int
    batch: int = 1
    cfg_scale: float = 5.0  # > 1: two CFG branches a step
    objective: str = "throughput"
    allow_reuse: bool = False
    gpu_memory_bytes: int = 0  # 0: the profile's; still 0: memory is not checked
    source: PlanSource | None = None  # DiTango's plan shapes (planner/plan_shape.py)
    quantize: str = "none"  # --quantize (planner/precision.py): fp8 rules out the weight-splitting layouts
    compile: bool = False  # --compile
    attention: str = "flash"  # its pricing (planner/precision.py `attention_pricing`): flash or flash3
    mix: tuple[tuple[VideoSize, int, float], ...] = ()  # the batch's items; empty: `batch` of the own
    workers: int = 1  # copies of the whole allocation pulling from the queue (Slurm array tasks)
    queue: str = "shared"  # QUEUES

    def __post_init__(self) -> None:
        check_quantize(self.quantize)
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention {self.attention!r}: priced as one of {', '.join(ATTENTION)}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.batch < 1:
            raise ConfigError(f"--batch must be >= 1, got {self.batch}")
        if self.mix and self.batch not in (1, len(self.mix)):
            raise ConfigError(f"a batch of {self.batch} with {len(self.mix)} items: give one of them")
        if self.queue not in QUEUES:
            raise ConfigError(f"--queue must be one of {', '.join(QUEUES)}, got {self.queue!r}")
        if self.workers < 1:
            raise ConfigError(f"the workers sharing the queue (--array) must be >= 1, got {self.workers}")

    @property
    def count(self) -> int:
        """The videos of the batch."""
        return len(self.mix) or self.batch

    def kinds(self) -> list[tuple[VideoSize, int, float]]:
        """The batch's distinct (size, steps, CFG scale), first seen first."""
        return list(dict.fromkeys(self.mix)) if self.mix else [(self.size, self.steps, self.cfg_scale)]


def replica_counts(nodes: int, gpus_per_node: int) -> list[int]:
    """Every replica count an allocation splits into evenly (planner/layout.py replica_shape)."""
    found = []
    for r in range(1, nodes * gpus_per_node + 1):
        try:
            replica_shape(nodes, gpus_per_node, r)
        except ConfigError:
            continue
        found.append(r)
    return found


def layouts(p: Problem, nodes: int, gpus: int) -> list[ParallelLayout]:
    """Every legal layout of one replica of nodes x gpus ranks for the model, for every item of
    the batch (as runtime/config.py refuses a run's layout for any one of them)."""
    world, out = nodes * gpus, []
    fewest = min(p.shape.tokens(size) for size, _, _ in p.kinds())
    # cfg-parallel needs two branches in every item, and a model that guides with more forwards
    # of its own (LTX-2) runs them all on one rank group
    guided = all(cfg > 1 for _, _, cfg in p.kinds()) and not p.shape.own_guidance
    for cfg in (1, 2) if guided and world % 2 == 0 else (1,):
        cp = world // cfg
        if cp > fewest:  # a rank without a token: the sequence cannot split so far
            continue
        if cp == 1:
            out.append(ParallelLayout(nodes, gpus, cfg, "none"))
            continue
        for strategy in STRATEGIES.values():
            if (strategy.reuses and not p.allow_reuse) or (strategy.splits_weights and p.quantize != "none"):
                continue
            for options in strategy.variants(cp):
                try:
                    layout = ParallelLayout(nodes, gpus, cfg, strategy, **options)
                    layout.check_model(p.shape.heads, p.shape.ffn, p.shape.joint_text, p.shape.own_guidance)
                except ConfigError:
                    continue
                out.append(layout)
    return out


def decode_seconds(hw: Hardware, shape: ModelShape, size: VideoSize, ranks: int) -> float:
    """The VAE decode of one video on `ranks` GPUs (tiled over them when more than one): the
    decoder's convolution FLOPs at each resolution, and the tiles' pixels sent to the writer."""
    vae = shape.vae
    if vae is None:
        return 0.0
    f, h, w = shape.latent_shape(size)
    flops = 0.0
    for frames in chunks(vae, f):
        for width, lf, i in zip(vae.widths, level_frames(vae, frames), range(len(vae.widths)), strict=True):
            flops += CONVS_PER_LEVEL * 2 * 27 * width * width * lf * h * w * 4**i
    if ranks > 1 and len(tile_grid(vae, h, w, 256)) > 1:
        flops *= TILE_OVERLAP
    compute = flops / max(1, ranks) / (hw.bf16_tflops * 1e12 * VAE_EFFICIENCY)
    pixels = 3 * output_frames(vae, f) * h * vae.spatial * w * vae.spatial * 4
    gather = pixels * (ranks - 1) / ranks / (hw.intra_gbps * 1e9 * ASSUMPTIONS["link_efficiency"]) if ranks > 1 else 0
    return compute + gather


def _timing(hw: Hardware, p: Problem, layout: ParallelLayout, shard: bool) -> tuple:
    """One video of `p`'s size, steps and CFG scale on `layout`: the cost model's estimate (one
    CFG branch: half of it), its decode's seconds and the blocks' launch overheads."""
    kwargs: dict = {"shard_weights": shard, "quantize": p.quantize, "compile": p.compile, "attention": p.attention}
    if layout.strategy.reuses and p.source is not None:
        plan = p.source.replay(layout, p.shape.layers, p.steps)
        if isinstance(plan, PlanReplay):
            kwargs.update(
                compute_fraction=plan.unit_fractions,
                own_group=p.source.own_group,
                plan_kinds=plan.kinds,
                planner=plan.planner,
            )
        else:
            kwargs.update(compute_fraction=plan, own_group=p.source.own_group)
    est = estimate(hw, layout, p.shape, p.size, p.steps, **kwargs)
    forwards = cfg_branches(p.cfg_scale, layout.cfg_degree) if layout.cfg_degree == 1 else 1
    if p.shape.own_guidance:  # its pipeline's forwards, whatever the video's CFG scale
        forwards = p.shape.guided_forwards
    elif p.cfg_scale <= 1:  # one branch: the cost model prices two when CFG runs on one rank group
        est.e2e_s /= 2
        est.inter_node_bytes //= 2
        est.intra_node_bytes //= 2
    overhead = p.steps * forwards * p.shape.layers * ASSUMPTIONS["block_overhead_us"] * 1e-6
    return est, decode_seconds(hw, p.shape, p.size, layout.world_size), overhead


def item_seconds(hw: Hardware, p: Problem, layout: ParallelLayout, shard: bool = False) -> float:
    """One video of `p`'s size, steps and CFG scale on one replica of `layout` (`shard`: weights
    FSDP-sharded), end to end: denoising, decode and launch overheads, as the search prices it.
    Its memory is not checked. What the work queue orders a batch's items by (longest first)."""
    est, decode, overhead = _timing(hw, p, layout, shard)
    return est.e2e_s + decode + overhead


def _price(hw: Hardware, p: Problem, replicas: int, layout: ParallelLayout, shard: bool) -> Choice | None:
    """`layout` priced, or None when it does not fit the GPU's memory."""
    branches = cfg_branches(p.cfg_scale, layout.cfg_degree)
    options = MemoryOptions(
        shard_weights=shard, cfg_branches_per_rank=branches, vae_parallel=layout.world_size > 1, quantize=p.quantize
    )
    memory = p.gpu_memory_bytes or hw.memory_bytes
    if memory:
        options = fit_to_memory(p.shape, layout, p.size, options, memory)
    peak = estimate_memory(p.shape, layout, p.size, options).peak_bytes
    if memory and peak > usable_bytes(memory):
        return None
    est, decode, overhead = _timing(hw, p, layout, shard)
    offload = [
        n for n, on in (("encoders", options.offload_text_encoder), ("transformer", options.offload_transformer)) if on
    ]
    inter, intra = est.inter_node_bytes, est.intra_node_bytes
    return Choice(replicas, layout, shard, est.e2e_s, decode, overhead, peak, inter, intra, offload)


def _schedule(hw: Hardware, p: Problem, choice: Choice) -> None:
    """`choice`'s batch time by `p.queue`, the static split's beside it, and its videos per hour.
    Each distinct item is priced once; the problem's own is the choice's."""
    one = replace(p, mix=(), batch=1)
    price = {
        kind: choice.e2e_s
        if kind == (p.size, p.steps, p.cfg_scale)
        else item_seconds(
            hw, replace(one, size=kind[0], steps=kind[1], cfg_scale=kind[2]), choice.layout, choice.shard_weights
        )
        for kind in p.kinds()
    }
    workers = choice.replicas * p.workers
    if p.mix:
        each = [price[kind] for kind in p.mix]
        choice.round_robin_s = round_robin_makespan(each, workers)
        choice.batch_s = lpt_makespan(each, workers)
    else:  # identical items: both schedules give the busiest worker ceil(batch / workers) of them
        choice.round_robin_s = choice.batch_s = math.ceil(p.batch / workers) * choice.e2e_s
    if p.queue == "static":  # rounds of the largest item, each array task its share (slurm/sharding.py)
        choice.batch_s = math.ceil(math.ceil(p.count / p.workers) / choice.replicas) * choice.e2e_s
    choice.videos_per_hour = p.count / choice.batch_s * 3600


def search(hw: Hardware, p: Problem) -> tuple[list[Choice], list[str]]:
    """Every layout that fits, best first by `p.objective`, and notes on what was left out."""
    check_fp8_hardware(hw, p.quantize)
    choices, notes, unfit = [], [], 0
    for replicas in replica_counts(p.nodes, p.gpus_per_node):
        nodes, gpus = replica_shape(p.nodes, p.gpus_per_node, replicas)
        for layout in layouts(p, nodes, gpus):
            choice = _price(hw, p, replicas, layout, False)
            if choice is None and layout.cp_degree > 1 and not layout.strategy.splits_weights:
                choice = _price(hw, p, replicas, layout, True)  # sharded only when whole weights do not fit
            if choice is None:
                unfit += 1
                continue
            _schedule(hw, p, choice)
            choices.append(choice)
    if unfit:
        notes.append(f"{unfit} layout(s) do not fit the GPU's memory")
    if not p.allow_reuse:
        notes.append("exact layouts only: DiTango reuses attention states (allow it with --allow-reuse)")
    if not (p.gpu_memory_bytes or hw.memory_bytes):
        notes.append("the GPU's memory is not known: no layout was checked against it (give --gpu-memory)")
    return rank(choices, p.objective), notes


def score(c: Choice, objective: str) -> float:
    """Higher is better: videos per hour, or one video's speed."""
    return c.videos_per_hour if objective == "throughput" else 1 / c.e2e_s if c.e2e_s else math.inf


def rank(choices: list[Choice], objective: str) -> list[Choice]:
    """Best first by `objective`; but the layouts within TIE of the best are the model's tie
    (its assumptions are coarser than that), and among them the one that moves the fewest bytes
    between nodes, then inside them, then holds the least memory, leads: it is the least
    exposed to a slower link than modelled."""
    ordered = sorted(choices, key=lambda c: (-score(c, objective), c.inter_node_bytes, c.peak_memory_bytes))
    if not ordered:
        return ordered
    top = score(ordered[0], objective)
    tied = [c for c in ordered if score(c, objective) >= top * (1 - TIE)]
    tied.sort(key=lambda c: (c.inter_node_bytes, c.intra_node_bytes, c.peak_memory_bytes, -score(c, objective)))
    return tied + ordered[len(tied) :]


def _lighter(a: Choice, b: Choice) -> str:
    """What `a` spares against `b`, in `rank`'s order."""
    if a.inter_node_bytes < b.inter_node_bytes:
        return f"moves {_bytes(b.inter_node_bytes - a.inter_node_bytes)} less between nodes"
    if a.intra_node_bytes < b.intra_node_bytes:
        return f"moves {_bytes(b.intra_node_bytes - a.intra_node_bytes)} less inside nodes"
    return f"holds {(b.peak_memory_bytes - a.peak_memory_bytes) / 2**30:.1f} GiB less a GPU"


def _bytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def seconds(s: float) -> str:
    """A modelled time as a reader wants it: 3 significant digits below 100 s."""
    return f"{s:.0f} s" if s >= 100 else f"{s:.3g} s"


def why(choices: list[Choice], p: Problem) -> str:
    """One sentence on why the first choice wins."""
    if not choices:
        return "no layout fits"
    best = choices[0]
    if p.objective == "throughput":
        text = f"{best.label}: {best.videos_per_hour:.1f} videos/h, " + _schedule_text(best, p)
        if best.replicas > 1:
            text += "; replicas exchange nothing with each other"
    else:
        text = (
            f"{best.label}: {seconds(best.e2e_s)} a video ({seconds(best.denoise_s)} denoising, "
            f"{seconds(best.decode_s)} decode)"
        )
    fastest = max(choices, key=lambda c: score(c, p.objective))
    if fastest is not best:
        gap = 100 * (1 - score(best, p.objective) / score(fastest, p.objective))
        text += f"; within {100 * TIE:g}% of the fastest, {fastest.label} ({gap:.2g}% behind it), it {_lighter(best, fastest)}"
    other = next((c for c in choices[1:] if c.label != best.label and c is not fastest), None)
    if other is not None:
        behind = 100 * (1 - score(other, p.objective) / score(best, p.objective))
        text += f"; the next, {other.label}, is {abs(behind):.2g}% {'behind' if behind >= 0 else 'ahead'}"
        if other.inter_node_bytes > best.inter_node_bytes:
            text += f" and moves {_bytes(other.inter_node_bytes - best.inter_node_bytes)} more between nodes"
    return text


def _schedule_text(c: Choice, p: Problem) -> str:
    """The schedule `c.batch_s` priced, in words."""
    tasks = f" in each of {p.workers} array tasks" if p.workers > 1 else ""
    if p.queue == "static":
        share = math.ceil(p.count / p.workers)
        rounds = math.ceil(share / c.replicas)
        text = f"{share} video(s){tasks} in {rounds} round(s) of {seconds(c.e2e_s)}"
        idle = rounds * c.replicas - share
        return text + (f"; {idle} replica(s) idle in the last round" if idle else "")
    text = f"{p.count} video(s) longest first over {c.replicas} replica(s){tasks} in {seconds(c.batch_s)}"
    if p.mix and c.round_robin_s > c.batch_s:
        text += f" (split round-robin: {seconds(c.round_robin_s)})"
    return text
