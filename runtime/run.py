"""Execute a RunConfig on this process: load the model once, generate every item.

Per item: text encode -> initial latents -> denoise -> decode -> MP4 (+ latents) ->
sidecar JSON. The sidecar is written last, so "MP4 and sidecar exist" means the item is
complete; such items are skipped unless `overwrite` is set. report.json is rewritten
after every item so an interrupted batch still has an up-to-date report.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from runtime.config import Item, RunConfig
from runtime.models.loading import load_components, resolve_placement
from runtime.models.registry import resolve_model
from runtime.pipeline import WanDenoiser, synchronize
from runtime.report import ItemTiming, item_record, read_sidecar, run_report
from runtime.video import write_json, write_latents, write_mp4


class Observer(Protocol):
    """What the runtime tells its caller (the CLI draws progress from it)."""

    def run_started(self, total: int) -> None: ...
    def item_started(self, item: Item) -> None: ...
    def step_done(self, step: int, steps: int) -> None: ...
    def item_finished(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...


class SilentObserver:
    def run_started(self, total: int) -> None: ...
    def item_started(self, item: Item) -> None: ...
    def step_done(self, step: int, steps: int) -> None: ...
    def item_finished(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...


def output_paths(out_dir: Path, item_id: str) -> dict[str, Path]:
    return {
        "video": out_dir / f"{item_id}.mp4",
        "sidecar": out_dir / f"{item_id}.json",
        "latents": out_dir / f"{item_id}.latents.safetensors",
    }


def completed_record(out_dir: Path, item: Item) -> dict | None:
    """The existing sidecar of a finished item (MP4 and sidecar both present), else None."""
    paths = output_paths(out_dir, item.id)
    if not paths["video"].is_file():
        return None
    record = read_sidecar(paths["sidecar"])
    if record is None or record.get("status") != "done":
        return None
    return record


def generate_item(denoiser: WanDenoiser, item: Item, cfg: RunConfig, observer: Observer) -> dict:
    paths = output_paths(cfg.out_dir, item.id)
    timing = ItemTiming()
    device = denoiser.device

    start = time.perf_counter()
    text = denoiser.encode_text(item.prompt, item.negative_prompt, item.guidance)
    synchronize(device)
    timing.text_encode_s = time.perf_counter() - start

    start = time.perf_counter()
    latents = denoiser.initial_latents(item.seed, item.height, item.width, item.frames)
    result = denoiser.denoise(latents, text, item.steps, item.guidance, on_step=observer.step_done)
    timing.denoise_s = time.perf_counter() - start
    timing.step_s = result.step_s

    start = time.perf_counter()
    frames = denoiser.decode(result.latents_BCFHW)
    synchronize(device)
    timing.decode_s = time.perf_counter() - start

    start = time.perf_counter()
    write_mp4(paths["video"], frames, cfg.fps)
    latents_name = None
    if cfg.save_latents:
        meta = {"id": item.id, "model": cfg.model, "seed": str(item.seed), "steps": str(item.steps)}
        write_latents(paths["latents"], result.latents_BCFHW, meta)
        latents_name = paths["latents"].name
    timing.write_s = time.perf_counter() - start

    record = item_record(item, status="done", video=paths["video"].name, latents=latents_name, timing=timing)
    write_json(paths["sidecar"], record)  # last: its presence marks the item complete
    return record


def execute(cfg: RunConfig, observer: Observer | None = None) -> dict:
    """Run every item of `cfg` on this process; returns the run report (also written to disk)."""
    observer = observer or SilentObserver()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    wall_start = time.perf_counter()
    placement = resolve_placement(cfg.device, cfg.dtype)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)

    records: dict[str, dict] = {}
    todo: list[Item] = []
    for item in cfg.items:
        done = None if cfg.overwrite else completed_record(cfg.out_dir, item)
        if done is not None:
            records[item.id] = {**done, "status": "skipped"}
            observer.message(f"skipping {item.id}: {item.id}.mp4 and {item.id}.json exist (use --overwrite)")
        else:
            todo.append(item)

    def write_report() -> dict:
        ordered = [records[i.id] for i in cfg.items if i.id in records]
        report = run_report(
            cfg, ordered, placement.device, placement.dtype_name, started, time.perf_counter() - wall_start
        )
        write_json(cfg.out_dir / "report.json", report)
        return report

    observer.run_started(len(todo))
    if todo:
        resolved = resolve_model(cfg.model if cfg.model_path is None else str(cfg.model_path))
        denoiser = WanDenoiser(load_components(resolved, placement), placement, cfg.max_text_len)
        for item in todo:
            observer.item_started(item)
            try:
                record = generate_item(denoiser, item, cfg, observer)
            except Exception as exc:  # one failed item must not lose the others
                record = item_record(
                    item,
                    status="failed",
                    video=None,
                    latents=None,
                    timing=None,
                    error=f"{type(exc).__name__}: {exc}",
                )
            records[item.id] = record
            observer.item_finished(record)
            write_report()
    return write_report()
