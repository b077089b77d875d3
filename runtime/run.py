"""Execute a RunConfig on this rank: load the model once, generate every item.

Per item: text encode -> initial latents -> denoise (all ranks; context-parallel
strategies installed on the transformer) -> on rank 0 only: decode -> MP4 (+ latents)
-> sidecar JSON. The sidecar is written last, so "MP4 and sidecar exist" means the item
is complete; rank 0 decides which items are complete and tells the others. report.json
is rewritten after every item so an interrupted batch still has an up-to-date report.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from datetime import datetime, timezone

import torch

from runtime.bring_up import Running, bring_up
from runtime.calibrate import hold_target
from runtime.config import DecodeOptions, Item, RunConfig
from runtime.context import Observer, RankContext, SilentObserver
from runtime.denoiser import Denoiser, synchronize
from runtime.errors import is_peer_failure
from runtime.inputs import exact_reference, item_inputs
from runtime.item_records import check_finite, gathered_records
from runtime.kernels import passes_attention_mask, resolve_backend
from runtime.loop_types import DenoiseResult, NonFiniteLatents
from runtime.models.loading import placement_on
from runtime.models.resolve import resolve_model
from runtime.profiling import StepProfiler, trace_name
from runtime.progress import ProgressFile, progress_path
from runtime.pull import QueueWork, StaticWork, own_decided, own_skips, worker_label
from runtime.quality import quality_record
from runtime.queue_status import queue_summary
from runtime.report import ItemTiming, ReportWriter, RunTiming, claim_bring_up_start, peak_memory, run_report
from runtime.resume import plan_resume
from runtime.video import Audio, write_json
from runtime.weights import place


def release_device_memory(device: torch.device) -> None:
    """Return the allocator's unused blocks to the GPU (the VAE decode at 720p needs them)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def generate_item(
    denoiser: Denoiser, item: Item, cfg: RunConfig, ctx: RankContext, observer: Observer, reference=None, work=None
) -> dict | None:
    """One item on this rank; `reference`: its exact final latents when already computed;
    `work`: where its files go (runtime/pull.py; default straight into OUT). The writer returns
    its record (None: its lease was taken over and its files discarded), the others {}."""
    work = work or StaticWork(cfg, [item])
    timing = ItemTiming()
    ctx.comm.reset()
    if ctx.is_writer:
        work.begin(cfg, item)
    # No rank starts the item before its marker exists: the writer may still be finishing the
    # previous item's video while the others are already here, and a failure in this item must
    # not be blamed on that one.
    ctx.from_writer(None)

    text, latents, condition = item_inputs(denoiser, item, cfg, timing)
    start = time.perf_counter()
    measured = cfg.reference == "exact" and (
        cfg.ditango is not None or cfg.step_cache is not None or cfg.quantize != "none"
    )
    trace = [] if measured and ctx.is_writer and reference is None else None  # the error per step, vs exact
    result, profile = denoise_item(denoiser, item, cfg, ctx, observer, (latents, text, condition), trace)
    timing.denoise_s = time.perf_counter() - start
    timing.step_s = result.step_s
    check_finite(result, item, ctx)
    records = item_records(denoiser, item, cfg, ctx, observer, profile)
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
    traces = (trace, exact_trace)
    return decode_and_write(
        denoiser, item, cfg, ctx, observer, result, reference, traces, timing, options, records, work
    )


def item_records(
    denoiser: Denoiser, item: Item, cfg: RunConfig, ctx: RankContext, observer: Observer, profile: dict | None
) -> dict:
    """What the ranks gather after the item's steps (runtime/item_records.py), with --profile
    every rank's table; says so when DiTango's reuse did not pay and the exact ring ran."""
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
    return records


def decode_and_write(
    denoiser: Denoiser,
    item: Item,
    cfg: RunConfig,
    ctx: RankContext,
    observer: Observer,
    result: DenoiseResult,
    reference: torch.Tensor | None,
    traces: tuple,
    timing: ItemTiming,
    options: DecodeOptions,
    records: dict,
    work,
) -> dict | None:
    """Decode the item's latents (every rank with tiles over them, else the writer), measure
    them against `reference` (the exact latents, or None), and on the writer write its files."""
    trace, exact_trace = traces
    device = denoiser.device
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
            quality["rel_err_per_step"] = [
                round(float((a - b).norm() / b.norm().clamp_min(1e-12)), 8)
                for a, b in zip(trace, exact_trace, strict=True)
            ]
    if cfg.reference == "exact" and options.tiled:  # what tiling costs: the same latents, untiled
        untiled = denoiser.decode(result.latents_BCFHW)
        decode["psnr_vs_untiled"] = quality_record(
            frames, untiled, result.latents_BCFHW, result.latents_BCFHW, "untiled"
        )["psnr"]

    audio, audio_record = item_audio(denoiser, result, cfg.no_audio)
    terms = getattr(denoiser.model, "guidance_record", None)
    if terms is not None:
        records = {**records, "guidance_terms": terms(item.cfg_scale, result.latents_BCFHW)}
    observer.phase("write")
    return work.write(
        cfg,
        item,
        frames,
        result.latents_BCFHW,
        timing,
        quality=quality,
        decode=decode,
        reference_frames=None if reference is None else ref_frames,
        track=audio,
        audio_latents=result.audio_BCLM,
        **({} if audio_record is None else {"audio": audio_record}),
        **records,
    )


def item_audio(denoiser: Denoiser, result: DenoiseResult, skip: bool) -> tuple[Audio | None, dict | None]:
    """The item's audio track (a model that denoises one with the video: LTX-2), decoded on the
    writer, and what the record says of it; (None, None) for a model without audio."""
    if result.audio_BCLM is None:
        return None, None
    record = {"latents": list(result.audio_BCLM.shape)}
    if skip:
        return None, {**record, "muxed": False, "why": "--no-audio"}
    start = time.perf_counter()
    samples, rate = denoiser.model.decode_audio(result.audio_BCLM)
    audio = Audio(samples, rate)
    return audio, {
        **record,
        "muxed": True,
        "codec": "aac",
        "sample_rate": rate,
        "channels": int(samples.shape[0]),
        "seconds": round(audio.seconds, 6),
        "decode_s": round(time.perf_counter() - start, 4),
    }


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
        cfg,
        [records[i.id] for i in cfg.items if i.id in records],
        cfg.device,
        cfg.dtype or "default",
        datetime.now(timezone.utc).isoformat(timespec="seconds"),
        0.0,
        attention_backend=cfg.attention_backend,
        rank_peaks=[peak],
        peak_source=source,
    )
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
    """
    bring_up_start = claim_bring_up_start(time.perf_counter())
    observer = observer or SilentObserver()
    ctx = ctx or RankContext.single(cfg)
    placement = placement_on(ctx.device, cfg.dtype)
    one_rank = cfg.layout.strategy.runtime is None  # one rank a branch: diffusers' attention runs the kernel
    masked = one_rank and passes_attention_mask(resolve_model(str(cfg.model_path or cfg.model)).spec.family)
    backend = resolve_backend(
        cfg.attention_backend, placement.device, placement.dtype, one_rank=one_rank, masked=masked
    )
    skipped = own_skips(cfg, plan_resume(cfg) if skipped is None else skipped)
    settled = {**skipped, **(decided or {})}
    records: dict[str, dict] = {**skipped, **own_decided(cfg, decided or {}, report_name)}
    report = ReportWriter(cfg, cfg.out_dir / report_name, placement.device, placement.dtype_name, backend, records)
    report.timing = RunTiming()
    heartbeat = None
    if ctx.is_writer:  # the writer's heartbeat file (`ditango status`), whatever launched this rank
        observer = heartbeat = writer_observer(cfg, observer, report_name, skipped, decided or {})
    todo = [item for item in cfg.items if item.id not in settled]
    observer.run_started(len(todo))
    try:
        if todo:
            report.timing.bring_up_s = time.perf_counter() - bring_up_start
            running = bring_up(cfg, ctx, placement, backend, todo, report, observer.message, report_name)
            generate_all(running, ctx, observer, report, records, report_name)
    except BaseException:
        if heartbeat is not None:  # `ditango status` must not show a run that ended as running
            heartbeat.write("stopped")
        raise
    if heartbeat is not None:
        heartbeat.finish()
    rank_peaks = [p for p, _ in ctx.gather(peak_memory(placement.device))]
    return report.write(rank_peaks) if ctx.is_writer else None


def writer_observer(cfg: RunConfig, observer: Observer, report_name: str, skipped: dict, decided: dict):
    """The writer's observer, which keeps its heartbeat file, once it said what it skips."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    heartbeat = ProgressFile(observer, progress_path(cfg.out_dir, report_name))
    for item_id in skipped:
        if item_id not in decided:  # not those this command already made in an earlier launch
            heartbeat.message(f"skipping {item_id}: {item_id}.mp4 and {item_id}.json exist (use --overwrite)")
    return heartbeat


def generate_all(
    running: Running, ctx: RankContext, observer: Observer, report: ReportWriter, records: dict, report_name: str
) -> None:
    """Every item `running` gets (its share in order, or what its writer claims from the queue:
    runtime/pull.py); the writer records each and rewrites the report.

    Non-finite latents are final at once: deterministic, every rank raised them at the same
    point (check_finite agrees first), so the ranks go on to the next item together; recorded
    `final`, the supervisor and later launches of this command (`settled_since`) never run it
    again. Under --target-psnr an item measured below the target recalibrates and runs again.
    Any other failure ends the replica; under the queue its writer first records the attempt
    failed (unless it only saw a peer go: the launcher then records the peer's error)."""
    items_start = time.perf_counter()
    work = item_source(running, ctx, observer, report_name)
    state = "stopped"
    try:
        for item in work:
            reference = running.first_reference if running.todo and item.id == running.todo[0].id else None
            record = one_item(running, item, ctx, observer, report, report_name, reference, work)
            report.timing.items_s = time.perf_counter() - items_start
            if ctx.is_writer and record is not None:
                records[item.id] = record
                report.timing.generated.append(item.id)
                observer.item_finished(record)
                report.queue = queue_summary(running.cfg.out_dir, running.cfg.queue.batch)
                report.write()
        state = "finished"
    finally:
        work.close(state)
        if ctx.is_writer:  # how its workers ended, this one's included
            report.queue = queue_summary(running.cfg.out_dir, running.cfg.queue.batch)


def item_source(running: Running, ctx: RankContext, observer: Observer, report_name: str):
    """Where this replica's items come from (runtime/pull.py)."""
    if not running.cfg.queue.shared:
        return StaticWork(running.cfg, running.todo)
    label = worker_label(report_name)
    return QueueWork(running.cfg, ctx, running.todo, observer, label)


def one_item(running: Running, item: Item, ctx, observer, report, report_name, reference, work) -> dict | None:
    """One item, its failure recorded (see `generate_all`); the writer's record, or None."""
    observer.item_started(item)
    if running.bank is not None:
        running.bank.use(item.loras)
    try:
        record = generate_item(running.denoiser, item, running.cfg, ctx, observer, reference, work)
        if report.calibration is not None and running.cfg.reference == "exact" and record:
            running.cfg, redo = hold_target(
                running.denoiser, item, running.cfg, ctx, observer.message, report_name, report.calibration, record
            )
            if redo is not None:
                record = generate_item(running.denoiser, item, running.cfg, ctx, observer, redo, work)
    except NonFiniteLatents as exc:
        return work.fail(running.cfg, item, f"{type(exc).__name__}: {exc}", True) if ctx.is_writer else {}
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        if ctx.is_writer and running.cfg.queue.shared and not is_peer_failure(message):
            with contextlib.suppress(Exception):  # the replica fails with its own error all the same
                work.fail(running.cfg, item, message, False)
        raise
    return record
