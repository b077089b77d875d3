"""The writer's files of a finished item: the MP4, its latents when asked, the plots and
DiTango's plan file, then the sidecar JSON, last, whose presence marks the item complete."""

from __future__ import annotations

import time

import numpy as np

from runtime.config import Item, RunConfig
from runtime.models.adapters import file_sha256
from runtime.outputs import output_paths, video_method
from runtime.plots import write_heatmap, write_rel_mae_plot, write_step_plot
from runtime.report import SCHEMA, ItemTiming, item_record
from runtime.video import Audio, write_json, write_latents, write_mp4, write_png


def write_item(
    cfg: RunConfig,
    item: Item,
    frames: np.ndarray,
    latents_BCFHW,
    timing: ItemTiming,
    *,
    attention: dict | None,
    hybrid: dict | None,
    reference_frames: np.ndarray | None = None,
    fence: dict | None = None,
    track: Audio | None = None,
    audio_latents=None,
    **records,
) -> dict:
    """Write `item`'s files (uint8 `frames` [F, H, W, 3]; float32 latents [1, C, F, H, W]; the
    exact run's frames, with --reference exact) and return its record; `records`: the rest of
    the record's parts (comm, quality, decode, step_cache). `fence`: the queue's lease the files
    are written under (batch, token, worker), kept in the sidecar; the sidecar also keeps the
    MP4's SHA-256, which says whose video was published. `track`: the audio muxed into the MP4
    (AAC); `audio_latents`: the audio stream's latents, kept beside the video's with --save-latents."""
    paths = output_paths(cfg.out_dir, item.id)
    start = time.perf_counter()
    write_mp4(paths["video"], frames, item.fps, track)
    write_png(paths["poster"], frames[len(frames) // 2])
    if reference_frames is not None and records.get("quality") is not None:
        write_mp4(paths["exact"], reference_frames, item.fps)
        records["quality"]["video"] = paths["exact"].name
    latents_name = None
    if cfg.save_latents:
        meta = {"id": item.id, "model": cfg.model, "seed": str(item.seed), "steps": str(item.steps)}
        write_latents(paths["latents"], latents_BCFHW, meta, audio_latents)
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
    write_step_plot(
        paths["steps"],
        timing.step_s,
        (attention or {}).get("per_step"),
        (attention or {}).get("plan", {}).get("kinds"),
        (records.get("quality") or {}).get("rel_err_per_step"),
    )
    record = item_record(
        item,
        model=cfg.model,
        status="done",
        video=paths["video"].name,
        latents=latents_name,
        timing=timing,
        attention=attention,
        hybrid=hybrid,
        method=video_method(cfg),
        **records,
    )
    record["poster"], record["steps_png"] = paths["poster"].name, paths["steps"].name
    record["video_sha256"] = file_sha256(paths["video"])
    if fence is not None:
        record["queue"] = fence
    write_json(paths["sidecar"], record)  # last: its presence marks the item complete
    return record
