"""Execute a RunConfig on this rank: load the model once, generate every item.

Per item: text encode -> initial latents -> denoise (all ranks; context-parallel
strategies installed on the transformer) -> on rank 0 only: decode -> MP4 (+ latents)
-> sidecar JSON. The sidecar is written last, so "MP4 and sidecar exist" means the item
is complete; rank 0 decides which items are complete and tells the others. report.json
is rewritten after every item so an interrupted batch still has an up-to-date report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Protocol

import numpy as np
import torch

from runtime.assembly import build_denoiser, host_loaded
from runtime.calibrate import hold_target, step_cache_ratios, target_quality
from runtime.comm import Comm
from runtime.config import DecodeOptions, Item, RunConfig, plan_memory
from runtime.denoiser import Denoiser, synchronize
from runtime.inputs import exact_reference, item_inputs
from runtime.kernels import resolve_backend
from runtime.loop_types import DenoiseResult, NonFiniteLatents
from runtime.mesh import Mesh, build_mesh
from runtime.models.loading import load_components, placement_on, resolve_placement
from runtime.models.registry import resolve_model
from runtime.outputs import mark_running, output_paths, plan_resume, record_failure
from runtime.plots import write_heatmap, write_rel_mae_plot
from runtime.quality import quality_record
from runtime.report import SCHEMA, ItemTiming, item_record, peak_memory, run_report
from runtime.video import write_json, write_latents, write_mp4
from runtime.weights import SHARDED, local_param_bytes, place, shard_weights


class Observer(Protocol):
    """What the runtime tells its caller (the CLI draws progress from it)."""

    def run_started(self, total: int) -> None: ...
    def item_started(self, item: Item) -> None: ...
    def step_done(self, step: int, steps: int) -> None: ...
    def phase(self, name: str) -> None: ...  # after the steps: "decode", then "write" (the writer)
    def item_finished(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...


class SilentObserver:
    def run_started(self, total: int) -> None: ...
    def item_started(self, item: Item) -> None: ...
    def step_done(self, step: int, steps: int) -> None: ...
    def phase(self, name: str) -> None: ...
    def item_finished(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...


@dataclass
class RankContext:
    """This rank's mesh and transport; a single process has a trivial one (no collectives)."""

    mesh: Mesh
    comm: Comm

    @classmethod
    def single(cls, cfg: RunConfig, device: torch.device | None = None) -> RankContext:
        """One process; `device` None: resolved from `cfg.device` (CUDA when asked or available)."""
        device = device or resolve_placement(cfg.device, cfg.dtype).device
        mesh = build_mesh(cfg.layout, 0, (0,), device=device)
        return cls(mesh, Comm(mesh))

    @property
    def device(self) -> torch.device:
        """This rank's device, chosen by its launcher (the local GPU of its global rank)."""
        return self.mesh.device

    @property
    def distributed(self) -> bool:
        return self.mesh.world_size > 1

    @property
    def is_writer(self) -> bool:
        return self.mesh.rank == 0

    # Object collectives go over the control group (gloo, setup timeout): they carry records,
    # not tensors, and the waits on the writer can last as long as a video's decode.
    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        return self.comm.gather_objects(obj, self.mesh.control_group, range(self.mesh.world_size))

    def from_writer(self, obj):
        if not self.distributed:
            return obj
        return self.comm.broadcast_object(obj, 0, self.mesh.control_group)


def sum_comm(per_rank: list[dict]) -> dict:
    total = {"intra_node_bytes": 0, "inter_node_bytes": 0, "by_purpose": {}}
    for t in per_rank:
        for link in ("intra_node_bytes", "inter_node_bytes"):
            total[link] += t[link]
        for purpose, links in t["by_purpose"].items():
            slot = total["by_purpose"].setdefault(purpose, {})
            for link, n in links.items():
                slot[link] = slot.get(link, 0) + n
    return total


def attention_record(denoiser: Denoiser, ctx: RankContext) -> dict | None:
    """DiTango's per-item plan record, with every rank's plan hash (they must be equal)."""
    ditango = denoiser.ditango
    if ditango is None:
        return None
    record = ditango.item_report()
    record["plan_hashes"] = ctx.gather(record.pop("plan_hash"))
    record["cache_peak_bytes"] = max(ctx.gather(record["cache_peak_bytes"]))
    return record


def step_cache_record(denoiser: Denoiser, ctx: RankContext) -> dict | None:
    """The step cache's per-item record, with every rank's decisions checked: the ranks that
    compute the same branch (one cp group) must have evaluated the same blocks and attention
    layers at every step, or their exchanges could not have paired up."""
    cache = denoiser.step_cache
    if cache is None:
        return None
    layers = len(denoiser.family.probes(denoiser.transformers[0]))
    decisions = ctx.gather((ctx.mesh.cfg_index, cache.record(layers)["per_step"]))
    if not all(d == next(e for c, e in decisions if c == i) for i, d in decisions):
        raise RuntimeError(f"step cache decisions differ across the ranks of a branch: {decisions}")
    merged = {}  # under --cfg-parallel each branch group ran one branch: both in the record
    for _, per_step in decisions:
        merged.update(per_step)
    return {**cache.record(layers, dict(sorted(merged.items()))), "ranks_agree": True}


def release_device_memory(device: torch.device) -> None:
    """Return the allocator's unused blocks to the GPU (the VAE decode at 720p needs them)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_finite(result: DenoiseResult, item: Item, ctx: RankContext) -> None:
    """Raise NonFiniteLatents on every rank alike when the final latents hold NaN/inf: a video
    decoded from them would be recorded done and be garbage. Every rank holds the same final
    latents; the counts are gathered all the same, so that no rank can go on into the next
    collective while another raises."""
    bad = int((~torch.isfinite(result.latents_BCFHW)).sum())
    agreed = ctx.gather((bad, result.first_nonfinite_step))
    bad = max(n for n, _ in agreed)
    if not bad:
        return
    steps = len(result.step_s)
    firsts = [s for _, s in agreed if s is not None]
    first = f"; first non-finite after step {min(firsts)}" if firsts else ""
    raise NonFiniteLatents(
        f"latents have {bad} NaN/inf values after step {steps} of {item.steps}{first} "
        "(a NaN/inf weight in the model, or a float16 overflow); not retried: it would happen again"
    )


def generate_item(
    denoiser: Denoiser, item: Item, cfg: RunConfig, ctx: RankContext, observer: Observer, reference=None
) -> dict:
    """One item on this rank; `reference`: its exact final latents when already computed."""
    paths = output_paths(cfg.out_dir, item.id)
    timing = ItemTiming()
    device = denoiser.device
    ctx.comm.reset()
    if ctx.is_writer:
        mark_running(cfg, item)
    # No rank starts the item before its marker exists: the writer may still be finishing the
    # previous item's video while the others are already here, and a failure in this item must
    # not be blamed on that one.
    ctx.from_writer(None)

    text, latents, condition = item_inputs(denoiser, item, cfg, timing)
    start = time.perf_counter()
    result = denoiser.denoise(
        latents, text, item.steps, item.cfg_scale, on_step=observer.step_done, condition=condition,
        guidance_2=item.guidance_2,
    )  # fmt: skip
    timing.denoise_s = time.perf_counter() - start
    timing.step_s = result.step_s
    check_finite(result, item, ctx)
    comm = sum_comm(ctx.gather(ctx.comm.totals()))
    attention = attention_record(denoiser, ctx)
    step_cache = step_cache_record(denoiser, ctx)
    hybrid = denoiser.guidance.record()
    if hybrid is not None:
        hybrid["block_evals"] = ctx.gather(hybrid["block_evals"])  # [rank][step]
        stage_bytes = ctx.gather(hybrid.pop("bytes_per_stage"))
        hybrid["bytes_per_stage"] = {
            s: sum(r.get(s, 0) for r in stage_bytes) for s in sorted(set().union(*stage_bytes))
        }
    if cfg.reference != "exact" or (cfg.ditango is None and cfg.step_cache is None):
        reference = None
    elif reference is None:
        start = time.perf_counter()
        reference = exact_reference(denoiser, latents, text, item, condition)
        timing.reference_s = time.perf_counter() - start
    options = before_decode(denoiser, cfg, ctx)
    if options is None:
        return {}

    observer.phase("decode")
    start = time.perf_counter()
    frames, decode = denoiser.decode_with(result.latents_BCFHW, options, ctx)  # every rank decodes tiles
    synchronize(device)
    timing.decode_s = time.perf_counter() - start
    if not ctx.is_writer:
        return {}
    quality = None
    if reference is not None:
        ref_frames, _ = denoiser.decode_with(reference, options.on_one_rank())  # decoded as the run's
        quality = quality_record(frames, ref_frames, result.latents_BCFHW, reference, "exact")
    if cfg.reference == "exact" and options.tiled:  # what tiling costs: the same latents, untiled
        untiled = denoiser.decode(result.latents_BCFHW)
        decode["psnr_vs_untiled"] = quality_record(frames, untiled, result.latents_BCFHW, result.latents_BCFHW,
                                                   "untiled")["psnr"]  # fmt: skip

    observer.phase("write")
    start = time.perf_counter()
    write_mp4(paths["video"], frames, cfg.fps)
    latents_name = None
    if cfg.save_latents:
        meta = {"id": item.id, "model": cfg.model, "seed": str(item.seed), "steps": str(item.steps)}
        write_latents(paths["latents"], result.latents_BCFHW, meta)
        latents_name = paths["latents"].name
    timing.write_s = time.perf_counter() - start

    if hybrid is not None:
        rel_mae_png = cfg.out_dir / f"{item.id}.rel_mae.png"
        write_rel_mae_plot(rel_mae_png, hybrid["rel_mae"], hybrid["stages"])
        hybrid["rel_mae_png"] = rel_mae_png.name
    if attention is not None:
        plan_file = cfg.out_dir / f"{item.id}.plan.json"  # the full (step, layer, unit) decisions
        write_json(plan_file, {"schema": SCHEMA, **attention.pop("plan_log")})
        attention["plan_file"] = plan_file.name
        plan_png = cfg.out_dir / f"{item.id}.plan.png"
        write_heatmap(plan_png, np.asarray(attention["plan"]["compute_map"], dtype=np.float64).reshape(item.steps, -1))
        attention["plan_png"] = plan_png.name
    record = item_record(
        item, model=cfg.model, status="done", video=paths["video"].name, latents=latents_name, timing=timing,
        comm=comm, attention=attention, quality=quality, hybrid=hybrid, decode=decode, step_cache=step_cache,
    )  # fmt: skip
    write_json(paths["sidecar"], record)  # last: its presence marks the item complete
    return record


def denoiser_for_run(cfg: RunConfig, ctx: RankContext, spec, components: dict, placement, backend: str) -> Denoiser:
    """The rank's denoiser over loaded `components`, as `cfg` asks (runtime/assembly.py)."""
    split = "transformer" in run_host_loaded(cfg, ctx) and not cfg.shard_weights
    return build_denoiser(
        components, placement, cfg.max_text_len, variant=spec.variant, mesh=ctx.mesh, comm=ctx.comm, backend=backend,
        ditango=cfg.ditango, step_cache=cfg.step_cache, hybrid=cfg.hybrid, split_on_host=split,
    )  # fmt: skip


def run_host_loaded(cfg: RunConfig, ctx: RankContext) -> tuple[str, ...]:
    """What `cfg` loads onto the CPU first on this rank (runtime/assembly.py's `host_loaded`)."""
    return host_loaded(cfg.layout.strategy, cfg.shard_weights, ctx.distributed)


def before_decode(denoiser: Denoiser, cfg: RunConfig, ctx: RankContext) -> DecodeOptions | None:
    """Make room for the decode (the transformer offloaded where the pre-flight chose so, what
    the denoising held returned to the device) and say how this rank decodes: the options, or
    None when it takes no part (not the writer, and the decode is not parallel)."""
    if "transformer" in cfg.offload:
        place(denoiser.transformers, torch.device("cpu"))  # the decode needs the room
    release_device_memory(denoiser.device)  # what the denoising held (DiTango's cache) goes back before the decode
    options = cfg.decode if ctx.distributed else replace(cfg.decode, parallel=False)
    return options if ctx.is_writer or options.parallel else None


def settled_report(cfg: RunConfig, records: dict[str, dict], report_name: str = "report.json") -> dict:
    """The report of a run with nothing left to do (every item skipped or settled), written
    by the launcher without starting a rank or loading the model."""
    peak, source = peak_memory(torch.device("cpu"))
    report = run_report(
        cfg, [records[i.id] for i in cfg.items if i.id in records], cfg.device, cfg.dtype or "default",
        datetime.now(timezone.utc).isoformat(timespec="seconds"), 0.0, attention_backend=cfg.attention_backend,
        rank_peaks=[peak], peak_source=source,
    )  # fmt: skip
    write_json(cfg.out_dir / report_name, report)
    return report


def execute(
    cfg: RunConfig,
    observer: Observer | None = None,
    ctx: RankContext | None = None,
    skipped: dict[str, dict] | None = None,
    report_name: str = "report.json",
    decided: dict[str, dict] | None = None,
) -> dict | None:
    """Run every item of `cfg` on this rank; rank 0 returns the run report (also written to disk).

    `skipped` holds the records of items whose outputs are complete (see `plan_resume`;
    the launcher decides once, before any rank starts); None: decide here. `decided`: records
    of items settled by earlier launches of the same command (done, or failed `cfg.retries + 1`
    times): reported as they are, not run.

    A failure raises, on one rank as on many (the peers are inside collectives of the same
    item): the supervisor (slurm/supervise.py) blames the item whose sidecar says it was
    running, and relaunches for what is left, retrying it up to `cfg.retries` times.
    Non-finite latents are the exception: every rank sees them at the same point, so the
    item is recorded failed for good (no retry: it would happen again) and all ranks go on.
    """
    observer = observer or SilentObserver()
    ctx = ctx or RankContext.single(cfg)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    wall_start = time.perf_counter()
    placement = placement_on(ctx.device, cfg.dtype)
    if cfg.layout.strategy == "none":
        backend = "diffusers"  # diffusers' own attention processor, untouched
    else:
        backend = resolve_backend(cfg.attention_backend, placement.device, placement.dtype)

    skipped = plan_resume(cfg) if skipped is None else skipped
    records: dict[str, dict] = {**skipped, **(decided or {})}
    if ctx.is_writer:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        for item_id in skipped:
            if item_id not in (decided or {}):  # not those this command already made in an earlier launch
                observer.message(f"skipping {item_id}: {item_id}.mp4 and {item_id}.json exist (use --overwrite)")
    todo = [item for item in cfg.items if item.id not in records]
    weights: dict = {"shard_degree": 1}  # the transformers' and text encoder's, on this rank
    calibration = None  # --target-psnr: the chosen cache ratio and its trials
    step_cache_run = None  # --step-cache magcache without mag_ratios: the ratios measured on item 1

    def write_report(rank_peaks: list[int] | None = None) -> dict:
        peak, source = peak_memory(placement.device)
        ordered = [records[i.id] for i in cfg.items if i.id in records]
        report = run_report(
            cfg, ordered, placement.device, placement.dtype_name, started, time.perf_counter() - wall_start,
            attention_backend=backend, rank_peaks=rank_peaks or [peak], peak_source=source,
        )  # fmt: skip
        report["weights"] = weights
        if calibration is not None:
            report["calibration"] = calibration
        if step_cache_run is not None:
            report["step_cache_calibration"] = step_cache_run
        write_json(cfg.out_dir / report_name, report)
        return report

    observer.run_started(len(todo))
    if todo:
        resolved = resolve_model(cfg.model if cfg.model_path is None else str(cfg.model_path))
        if placement.device.type == "cuda" and cfg.gpu_memory is None:  # submitted without a GPU to ask
            total = torch.cuda.get_device_properties(placement.device).total_memory
            cfg = plan_memory(cfg, resolved.spec.shape, total, placement.dtype.itemsize, cfg.model)
        shard = cfg.shard_weights and ctx.distributed
        components = load_components(resolved, placement, on_cpu=run_host_loaded(cfg, ctx))
        if shard:
            weights["shard_degree"] = shard_weights(components, ctx.mesh, placement.device)
        denoiser = denoiser_for_run(cfg, ctx, resolved.spec, components, placement, backend)
        weights["param_bytes_per_rank"] = sum(local_param_bytes(components[n]) for n in SHARDED if n in components)
        first_reference = None
        if denoiser.step_cache is not None and denoiser.step_cache.needs_calibration:
            step_cache_run, first_reference = step_cache_ratios(
                denoiser, todo[0], cfg, ctx, observer.message, report_name
            )
        if cfg.ditango is not None and cfg.ditango.target_psnr is not None:
            cfg, calibration, first_reference = target_quality(
                denoiser, todo[0], cfg, ctx, observer.message, report_name
            )
        for item in todo:
            observer.item_started(item)
            reference, first_reference = first_reference, None
            try:
                record = generate_item(denoiser, item, cfg, ctx, observer, reference)
                if calibration is not None and cfg.reference == "exact":  # measured: below the target, recalibrate
                    cfg, redo = hold_target(
                        denoiser, item, cfg, ctx, observer.message, report_name, calibration, record
                    )
                    if redo is not None:
                        record = generate_item(denoiser, item, cfg, ctx, observer, redo)
            except NonFiniteLatents as exc:
                # Deterministic, so final at once. Every rank raised it at the same point
                # (check_finite agrees first), so the ranks go on to the next item together.
                # Recorded `final`: the supervisor and later launches of this command
                # (`settled_since`) count it as given up and never run it again.
                record = {}
                if ctx.is_writer:
                    record = record_failure(cfg, item, f"{type(exc).__name__}: {exc}", 1, final=True)
            if ctx.is_writer:
                records[item.id] = record
                observer.item_finished(record)
                write_report()
    rank_peaks = [p for p, _ in ctx.gather(peak_memory(placement.device))]
    return write_report(rank_peaks) if ctx.is_writer else None
