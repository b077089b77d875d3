"""Execute a RunConfig on this rank: load the model once, generate every item.

Per item: text encode -> initial latents -> denoise (all ranks; context-parallel
strategies installed on the transformer) -> on rank 0 only: decode -> MP4 (+ latents)
-> sidecar JSON. The sidecar is written last, so "MP4 and sidecar exist" means the item
is complete; rank 0 decides which items are complete and tells the others. report.json
is rewritten after every item so an interrupted batch still has an up-to-date report.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone

import torch

from runtime.assembly import build_denoiser, host_loaded
from runtime.calibrate import hold_target, step_cache_ratios, target_quality
from runtime.config import DecodeOptions, Item, RunConfig
from runtime.context import Observer, RankContext, SilentObserver
from runtime.denoiser import Denoiser, synchronize
from runtime.inputs import exact_reference, item_inputs
from runtime.item_records import check_finite, gathered_records
from runtime.kernels import resolve_backend
from runtime.loop_types import DenoiseResult, NonFiniteLatents
from runtime.memory_plan import plan_memory
from runtime.models.adapters import adapter_sets, same_weights
from runtime.models.loading import load_components, placement_on
from runtime.models.resolve import resolve_model
from runtime.outputs import mark_running, plan_resume, record_failure
from runtime.profiling import StepProfiler, trace_name
from runtime.progress import ProgressFile, progress_path
from runtime.quality import quality_record
from runtime.report import ItemTiming, ReportWriter, RunTiming, claim_bring_up_start, peak_memory, run_report
from runtime.video import write_json
from runtime.weights import SHARDED, local_param_bytes, place, shard_weights
from runtime.writer import write_item


def release_device_memory(device: torch.device) -> None:
    """Return the allocator's unused blocks to the GPU (the VAE decode at 720p needs them)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def generate_item(
    denoiser: Denoiser, item: Item, cfg: RunConfig, ctx: RankContext, observer: Observer, reference=None
) -> dict:
    """One item on this rank; `reference`: its exact final latents when already computed."""
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
    measured = cfg.reference == "exact" and (cfg.ditango is not None or cfg.step_cache is not None)
    trace = [] if measured and ctx.is_writer and reference is None else None  # the error per step, vs exact
    result, profile = denoise_item(denoiser, item, cfg, ctx, observer, (latents, text, condition), trace)
    timing.denoise_s = time.perf_counter() - start
    timing.step_s = result.step_s
    check_finite(result, item, ctx)
    records = gathered_records(denoiser, ctx)
    reuse = (records["attention"] or {}).get("reuse")
    if ctx.is_writer and reuse is not None and not reuse["pays"]:
        observer.message(
            f"{item.id}: DiTango's reuse would cost more than it saves here (bookkeeping "
            f"{reuse['bookkeeping_us_per_layer']:.0f} us > {reuse['saved_us_per_layer']:.0f} us saved per layer on "
            f"{reuse['hardware']}): the exact ring ran (--reuse always reuses anyway)"
        )
    if cfg.profile:  # every rank's table, and where its trace is
        traces = [trace_name(item.id, r) for r in range(ctx.mesh.world_size)]
        records["profile"] = {"per_rank": ctx.gather(profile), "traces": traces}
    exact_trace = None if trace is None else []
    if not measured:
        reference = None
    elif reference is None:
        start = time.perf_counter()
        reference = exact_reference(denoiser, latents, text, item, condition, exact_trace)
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
        if trace and exact_trace:  # ||run - exact|| / ||exact|| of the latents after each step
            quality["rel_err_per_step"] = [round(float((a - b).norm() / b.norm().clamp_min(1e-12)), 8)
                                           for a, b in zip(trace, exact_trace, strict=True)]  # fmt: skip
    if cfg.reference == "exact" and options.tiled:  # what tiling costs: the same latents, untiled
        untiled = denoiser.decode(result.latents_BCFHW)
        decode["psnr_vs_untiled"] = quality_record(frames, untiled, result.latents_BCFHW, result.latents_BCFHW,
                                                   "untiled")["psnr"]  # fmt: skip

    observer.phase("write")
    return write_item(cfg, item, frames, result.latents_BCFHW, timing, quality=quality, decode=decode,
                      reference_frames=None if reference is None else ref_frames, **records)  # fmt: skip


def denoise_item(
    denoiser: Denoiser, item: Item, cfg: RunConfig, ctx: RankContext, observer: Observer, inputs: tuple, trace
) -> tuple[DenoiseResult, dict | None]:
    """The item's steps from `inputs` (latents, text, condition): the result, and with
    --profile this rank's table of where the time went (runtime/profiling.py)."""
    latents, text, condition = inputs
    profiler = None
    if cfg.profile:
        profiler = StepProfiler(denoiser.device, item.steps, cfg.out_dir / trace_name(item.id, ctx.mesh.rank))
    try:
        result = denoiser.denoise(
            latents,
            text,
            item.steps,
            item.cfg_scale,
            on_step=observer.step_done if profiler is None else profiler.observing(observer.step_done),
            condition=condition,
            guidance_2=item.guidance_2,
            sampler=item.sampler,
            trace=trace,
        )
    except BaseException:
        if profiler is not None:
            profiler.abandon()
        raise
    return result, None if profiler is None else profiler.finish(len(result.step_s))


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
    bring_up_start = claim_bring_up_start(time.perf_counter())
    observer = observer or SilentObserver()
    ctx = ctx or RankContext.single(cfg)
    placement = placement_on(ctx.device, cfg.dtype)
    if cfg.layout.strategy.runtime is None:
        backend = "diffusers"  # diffusers' own attention processor, untouched
    else:
        backend = resolve_backend(cfg.attention_backend, placement.device, placement.dtype)

    skipped = plan_resume(cfg) if skipped is None else skipped
    records: dict[str, dict] = {**skipped, **(decided or {})}
    report = ReportWriter(cfg, cfg.out_dir / report_name, placement.device, placement.dtype_name, backend, records)
    report.timing = timing = RunTiming()
    heartbeat = None
    if ctx.is_writer:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        # The writer's heartbeat file (`ditango status`), whatever launched this rank.
        observer = heartbeat = ProgressFile(observer, progress_path(cfg.out_dir, report_name))
        for item_id in skipped:
            if item_id not in (decided or {}):  # not those this command already made in an earlier launch
                observer.message(f"skipping {item_id}: {item_id}.mp4 and {item_id}.json exist (use --overwrite)")
    todo = [item for item in cfg.items if item.id not in records]

    observer.run_started(len(todo))
    try:
        if todo:
            started = time.perf_counter()
            timing.bring_up_s = started - bring_up_start
            resolved = resolve_model(cfg.model if cfg.model_path is None else str(cfg.model_path))
            if placement.device.type == "cuda" and cfg.gpu_memory is None:  # submitted without a GPU to ask
                total = torch.cuda.get_device_properties(placement.device).total_memory
                cfg = plan_memory(cfg, resolved.spec.shape, total, placement.dtype.itemsize, cfg.model)
            shard = cfg.shard_weights and ctx.distributed
            sets = adapter_sets(todo)
            todo.sort(key=lambda item: sets.index(item.loras))  # a set at a time: the model loaded once
            components = load_components(resolved, placement, on_cpu=run_host_loaded(cfg, ctx), adapter_sets=sets)
            bank = components.pop("adapters", None)
            if bank is not None:
                same_weights(components, ctx)
                report.weights.update(model_loads=1, adapter_sets=len(sets), adapters_fused=bank.fused)
            if shard:
                report.weights["shard_degree"] = shard_weights(components, ctx.mesh, placement.device)
            denoiser = denoiser_for_run(cfg, ctx, resolved.spec, components, placement, backend)
            report.weights["param_bytes_per_rank"] = sum(
                local_param_bytes(components[n]) for n in SHARDED if n in components
            )
            calibrating = time.perf_counter()
            timing.model_load_s = calibrating - started
            first_reference = None
            if denoiser.step_cache is not None and denoiser.step_cache.needs_calibration:
                report.step_cache_calibration, first_reference = step_cache_ratios(
                    denoiser, todo[0], cfg, ctx, observer.message, report_name
                )
            if cfg.ditango is not None and cfg.ditango.target_psnr is not None:
                cfg, report.calibration, first_reference = target_quality(
                    denoiser, todo[0], cfg, ctx, observer.message, report_name
                )
            items_start = time.perf_counter()
            timing.calibration_s = items_start - calibrating
            for item in todo:
                observer.item_started(item)
                reference, first_reference = first_reference, None
                if bank is not None:
                    bank.use(item.loras)
                try:
                    record = generate_item(denoiser, item, cfg, ctx, observer, reference)
                    if report.calibration is not None and cfg.reference == "exact":  # below the target: recalibrate
                        cfg, redo = hold_target(
                            denoiser, item, cfg, ctx, observer.message, report_name, report.calibration, record
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
                timing.items_s = time.perf_counter() - items_start
                if ctx.is_writer:
                    records[item.id] = record
                    timing.generated.append(item.id)
                    observer.item_finished(record)
                    report.write()
    except BaseException:
        if heartbeat is not None:  # `ditango status` must not show a run that ended as running
            heartbeat.write("stopped")
        raise
    if heartbeat is not None:
        heartbeat.finish()
    rank_peaks = [p for p, _ in ctx.gather(peak_memory(placement.device))]
    return report.write(rank_peaks) if ctx.is_writer else None
