"""`--target-psnr DB`: the DiTango cache ratio for a quality target instead of a knob.

Before the batch, the first item to run is denoised exactly (the ring path, as
`--reference exact` does) and then with DiTango at trial cache ratios, bisecting between 0
(exact) and MAX_RATIO: a trial whose decoded frames reach the target PSNR against the exact
frames raises the lower end, one that misses lowers the upper end. The largest ratio that
reached the target is used for every item of the batch; none reached it: 0, exact attention.
Every rank runs every trial (the denoise is collective); only the writer decodes and
measures, and it sends each verdict to the others, so all ranks bisect alike.

With --reference exact every item is measured anyway: an item that lands more than
TOLERANCE_DB below the target (items differ: at one ratio the built-in model's prompts
span 33-45 dB) is calibrated again, between 0 and the ratio in force, and redone, and the
lower ratio holds for the rest of the batch.

The result is kept in OUT/.ditango/calibration/<report name>, so a relaunch of the same
command (a retry, a requeue, a resume) uses the same ratio instead of calibrating again on
another item; a different target, model, planner setting or layout calibrates anew.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from runtime.inputs import exact_reference, item_inputs
from runtime.outputs import STATE_DIR, Damaged, read_json
from runtime.quality import psnr
from runtime.video import write_json
from runtime.weights import place

# bisection steps: the chosen ratio is within MAX_RATIO / 2**TRIALS (0.03) of the largest that reaches the target
TRIALS = 5
TOLERANCE_DB = 2.0  # with --reference exact, an item measured further below the target recalibrates
MAX_RATIO = 0.95


def calibration_path(out_dir: Path, report_name: str) -> Path:
    return out_dir / STATE_DIR / "calibration" / report_name


def calibration_key(cfg) -> dict:
    """What a stored calibration must match to be reused (not the item: a relaunch starts at
    the first item left to do)."""
    planner = cfg.ditango.planner
    return {
        "target_psnr": cfg.ditango.target_psnr,
        "model": cfg.model,
        "planner": {k: v for k, v in vars(planner).items() if k != "cache_ratio"},
        "layout": cfg.layout.to_json(),
    }


def stored_calibration(path: Path, key: dict) -> dict | None:
    try:
        record = read_json(path, "calibration")
    except Damaged:
        return None  # calibrated again, and rewritten
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return record


def calibrate(
    denoiser, item, cfg, ctx, inputs, reference_latents, message=lambda text: None, upper: float = MAX_RATIO
) -> dict:
    """Bisect the cache ratio in [0, `upper`] on `item` (its encoded `inputs`: text, latents,
    condition) against its exact final latents; returns the calibration record (chosen
    ratio, trials)."""
    selective = denoiser.ditango
    base = selective.planner_cfg
    target = cfg.ditango.target_psnr
    options = cfg.decode.on_one_rank()  # the writer decodes, tiled as the run, as --reference exact does
    text, latents, condition = inputs
    start = time.perf_counter()
    ref_frames = writer_decode(denoiser, reference_latents, options, cfg) if ctx.is_writer else None
    ctx.from_writer(None)  # the others wait here (setup timeout), not in the first trial's step
    lo, hi, trials = 0.0, upper, []
    try:
        for _ in range(TRIALS):
            ratio = round((lo + hi) / 2, 4)
            selective.planner_cfg = replace(base, cache_ratio=ratio)
            result = denoiser.denoise(
                latents,
                text,
                item.steps,
                item.cfg_scale,
                condition=condition,
                guidance_2=item.guidance_2,
                sampler=item.sampler,
            )
            measured = None
            if ctx.is_writer:
                measured = psnr(writer_decode(denoiser, result.latents_BCFHW, options, cfg), ref_frames)
            measured = ctx.from_writer(measured)
            trials.append({"cache_ratio": ratio, "psnr": None if math.isinf(measured) else round(measured, 4)})
            message(f"--target-psnr {target:g}: cache ratio {ratio:g} gives {measured:.2f} dB")
            if measured >= target:
                lo = ratio
            else:
                hi = ratio
    finally:
        selective.planner_cfg = base
    reached = [t for t in trials if t["cache_ratio"] == lo]
    return {
        "target_psnr": target,
        "item": item.id,
        "planner": base.planner,
        "cache_ratio": lo,
        "calibrated_psnr": reached[0]["psnr"] if reached else None,  # None: exact (or identical frames)
        "trials": trials,
        "seconds": round(time.perf_counter() - start, 3),
    }


def writer_decode(denoiser, latents, options, cfg):
    """The writer's frames of `latents`, with the transformers off the GPU meanwhile when the
    memory pre-flight chose so for the run's decode (`cfg.offload`), and back for the next trial."""
    offload = "transformer" in cfg.offload
    if offload:
        place(denoiser.transformers, torch.device("cpu"))
    try:
        return denoiser.decode_with(latents, options)[0]
    finally:
        if offload:
            place(denoiser.transformers, denoiser.device)


def apply_calibration(denoiser, cfg, record: dict):
    """`cfg` (and the installed runtime) with the calibrated cache ratio."""
    planner = replace(cfg.ditango.planner, cache_ratio=record["cache_ratio"])
    denoiser.ditango.planner_cfg = planner
    return replace(cfg, ditango=replace(cfg.ditango, planner=planner))


def save_calibration(path: Path, key: dict, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"key": key, **record})


def exact_run(denoiser, item, cfg) -> tuple:
    """(the item's encoded inputs, its exact final latents): what a calibration measures against."""
    inputs = item_inputs(denoiser, item, cfg)
    text, latents, condition = inputs
    return inputs, exact_reference(denoiser, latents, text, item, condition)


def step_cache_ratios(denoiser, item, cfg, ctx, message, report_name: str) -> tuple[dict, object]:
    """MagCache's ratios for the batch: those a launch of the same command stored, else
    measured on `item` and stored. Returns (the record for the report, `item`'s exact latents
    when measured now, else None)."""
    cache = denoiser.step_cache
    path = calibration_path(cfg.out_dir, "magcache-" + report_name)
    key = {"model": cfg.model, "layout": cfg.layout.to_json(), "step_cache": cache.spec.to_json()}
    record = ctx.from_writer(stored_calibration(path, key) if ctx.is_writer else None)
    if record is not None:
        cache.mag_ratios = record["mag_ratios"]
        return {k: v for k, v in record.items() if k != "key"}, None
    reference = calibrate_step_cache(denoiser, item, cfg, ctx, message)
    record = {"mag_ratios": cache.mag_ratios, "calibrated_on": item.id}
    if ctx.is_writer:
        save_calibration(path, key, record)
    return record, reference


def calibrate_step_cache(denoiser, item, cfg, ctx, message):
    """MagCache without ratios: denoise `item` exactly with the cache in calibration mode (it
    measures, never skips) and keep the conditional branch's ratios for the batch (as diffusers
    logs one list), the same on every rank (under --cfg-parallel only some ranks run that
    branch). Returns the item's exact latents."""
    cache = denoiser.step_cache
    message(f"measuring magcache's ratios on {item.id} (one exact run)")
    cache.calibrating = True
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # diffusers prints the (here empty) list
            _, reference = exact_run(denoiser, item, cfg)
    finally:
        cache.calibrating = False
    measured = ctx.gather(cache.take_calibration())
    ratios = next((m["cond"] for m in measured if "cond" in m), None) or next(r for m in measured for r in m.values())
    cache.mag_ratios = ratios
    return reference


def target_quality(denoiser, item, cfg, ctx, message, report_name: str):
    """(cfg with the calibrated cache ratio, the calibration record, the exact final latents of
    `item` if computed now, else None). A stored calibration of the same command is reused."""
    path, key = calibration_path(cfg.out_dir, report_name), calibration_key(cfg)
    record = ctx.from_writer(stored_calibration(path, key) if ctx.is_writer else None)
    reference = None
    if record is None:
        message(f"calibrating --target-psnr {cfg.ditango.target_psnr:g} on {item.id}")
        inputs, reference = exact_run(denoiser, item, cfg)
        record = calibrate(denoiser, item, cfg, ctx, inputs, reference, message)
        record["recalibrated"] = []
        if ctx.is_writer:
            save_calibration(path, key, record)
    record = {k: v for k, v in record.items() if k != "key"}
    message(f"--target-psnr {record['target_psnr']:g}: cache ratio {record['cache_ratio']:g}")
    return apply_calibration(denoiser, cfg, record), record, reference


def hold_target(denoiser, item, cfg, ctx, message, report_name: str, record: dict, item_record: dict):
    """With --reference exact every item is measured: one more than TOLERANCE_DB below the
    target bisects again on that item, between 0 and the ratio in force, and the batch goes on
    with the lower ratio (it never rises again). Returns (cfg, the item's exact latents to
    redo it with) or (cfg, None) when it held. `record` (the calibration) is updated in place."""
    quality = (item_record or {}).get("quality") or {}
    measured = ctx.from_writer(quality.get("psnr") if ctx.is_writer else None)  # None: identical, or not done
    target, ratio = record["target_psnr"], record["cache_ratio"]
    if measured is None or measured >= target - TOLERANCE_DB or ratio == 0:
        return cfg, None
    message(f"{item.id}: {measured:.2f} dB at cache ratio {ratio:g}, below --target-psnr {target:g}: recalibrating")
    inputs, reference = exact_run(denoiser, item, cfg)
    again = calibrate(denoiser, item, cfg, ctx, inputs, reference, message, upper=ratio)
    # The top level says what is in force (ratio, the item it was calibrated on, its PSNR there);
    # the history, what each recalibration saw.
    record.setdefault("recalibrated", []).append(
        {"item": item.id, "psnr": measured, "from": ratio, "to": again["cache_ratio"], "trials": again["trials"]}
    )
    record.update(cache_ratio=again["cache_ratio"], item=item.id, calibrated_psnr=again["calibrated_psnr"])
    if ctx.is_writer:
        save_calibration(calibration_path(cfg.out_dir, report_name), calibration_key(cfg), record)
    return apply_calibration(denoiser, cfg, record), reference
