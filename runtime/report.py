"""Versioned JSON records: one sidecar per item and `report.json` for the run (schema 1)."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from runtime.compile import CompileRecord
from runtime.config import Item, RunConfig
from runtime.gallery import write_gallery
from runtime.profiling import summary as profile_summary
from runtime.video import write_json

SCHEMA = 1


def versions() -> dict[str, str]:
    import diffusers

    try:
        ours = metadata.version("ditango")
    except metadata.PackageNotFoundError:
        ours = "0+unknown"
    return {
        "ditango": ours,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": sys.version.split()[0],
    }


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_max_rss"


@dataclass
class ItemTiming:
    text_encode_s: float = 0.0
    denoise_s: float = 0.0
    decode_s: float = 0.0
    write_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    reference_s: float | None = None  # --reference exact: the extra exact run (not in total_s)

    def to_json(self) -> dict:
        total = self.text_encode_s + self.denoise_s + self.decode_s + self.write_s
        return {
            "total_s": round(total, 6),
            "text_encode_s": round(self.text_encode_s, 6),
            "denoise_s": round(self.denoise_s, 6),
            "decode_s": round(self.decode_s, 6),
            "write_s": round(self.write_s, 6),
            "step_s": [round(s, 6) for s in self.step_s],
            "reference_s": None if self.reference_s is None else round(self.reference_s, 6),
        }


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


# perf_counter() at this process's start (else at this import), claimed by its first run.
_process_start: float | None = time.perf_counter() - (process_age_s() or 0.0)


def claim_bring_up_start(called: float) -> float:
    """The perf_counter() time a run's bring-up counts from: the process start for the first
    run of a process (its imports, process group and mesh all come before `execute`), else
    `called`, that run's own start (a local one-rank run executes its array tasks and retries
    one after another in the CLI process)."""
    global _process_start
    start, _process_start = (called if _process_start is None else _process_start), None
    return start


@dataclass
class RunTiming:
    """Where a run's wall time went, for report.json's `timing` (videos per hour over all of
    it, not only the items): bring-up (from the rank's process start, or the run's own start
    for a later run in the same process, to the model load: imports, process group, mesh,
    resume), the model load (resolve, load, shard, build the denoiser), the calibration (a
    step cache's or --target-psnr's trials) and the items (first start to last end); decode and
    write are the sums over the items this run generated (part of items_s)."""

    bring_up_s: float = 0.0
    model_load_s: float = 0.0
    calibration_s: float = 0.0
    items_s: float = 0.0
    compile_s: float = 0.0  # --compile: the compiled blocks' first calls per item shape (part of items_s)
    generated: list[str] = field(default_factory=list)  # ids of the items this run generated

    def to_json(self, records: dict[str, dict]) -> dict:
        timings = [records[i].get("timing") or {} for i in self.generated if i in records]
        return {
            "bring_up_s": round(self.bring_up_s, 6),
            "model_load_s": round(self.model_load_s, 6),
            "calibration_s": round(self.calibration_s, 6),
            "items_s": round(self.items_s, 6),
            "compile_s": round(self.compile_s, 6),
            "decode_s": round(sum(t.get("decode_s") or 0.0 for t in timings), 6),
            "write_s": round(sum(t.get("write_s") or 0.0 for t in timings), 6),
            "items": len(timings),
        }


TIMING_SUMS = ("bring_up_s", "model_load_s", "calibration_s", "items_s", "compile_s", "decode_s", "write_s", "items")


def item_record(
    item: Item,
    *,
    model: str,
    status: str,
    video: str | None,
    latents: str | None,
    timing: ItemTiming | None,
    comm: dict | None = None,
    attention: dict | None = None,
    quality: dict | None = None,
    hybrid: dict | None = None,
    decode: dict | None = None,
    error: str | None = None,
    step_cache: dict | None = None,
    method: dict | None = None,
    profile: dict | None = None,
    audio: dict | None = None,
    guidance_terms: dict | None = None,
) -> dict:
    """The per-item record: the sidecar's body and one entry of report.json's `items`."""
    return {
        "schema": SCHEMA,
        "id": item.id,
        "status": status,
        "model": model,
        **{k: v for k, v in item.to_json().items() if k != "id"},
        "video": video,
        "latents": latents,
        "timing": None if timing is None else timing.to_json(),
        # Bytes summed over ranks, by the link class they crossed (see runtime/comm.py).
        "comm": comm or {"intra_node_bytes": 0, "inter_node_bytes": 0, "by_purpose": {}},
        # Exact strategies compute every attention partition fresh; DiTango reports its plan.
        "attention": attention or {"computed_fraction_all_steps": 1.0},
        "quality": quality,  # with --reference exact: psnr, ssim, latent_rel_err vs the exact run
        # with --step-cache: its options, per branch and step the blocks and self-attention layers
        # evaluated, the steps whose blocks were skipped, the fractions evaluated
        "step_cache": step_cache,
        "hybrid": hybrid,  # with --hybrid: tau1, tau2, rel_mae and stage per step, block evals, bytes per stage
        # mode (tiled/untiled), tiles, ranks, per_rank_s (decode time of each rank), bytes (tiles
        # sent to the writer), psnr_vs_untiled (with --reference exact and a tiled decode)
        "decode": decode,
        # What besides the fields above shapes the video ({}: an exact run; runtime/outputs.py
        # video_method): a folder's items are resumed only under the same.
        "method": method or {},
        # with --profile: per rank, ms per profiled step by category (runtime/profiling.py), and the traces
        "profile": profile,
        # a model that denoises an audio track with the video (LTX-2): its latents' shape, and
        # muxed (AAC, sample_rate, channels, seconds) or why not (--no-audio)
        "audio": audio,
        # a pipeline's guidance beyond the CFG scale (LTX-2: audio CFG, spatio-temporal and
        # modality guidance, rescale, the shift's mu from the whole video's tokens)
        "guidance_terms": guidance_terms,
        "error": error,
    }


def run_report(
    cfg: RunConfig,
    records: list[dict],
    device: torch.device,
    dtype: str,
    started: str,
    wall_s: float,
    *,
    attention_backend: str,
    rank_peaks: list[int],
    peak_source: str,
) -> dict:
    counts = {s: sum(r.get("status") == s for r in records) for s in ("done", "skipped", "failed")}
    return {
        "schema": SCHEMA,
        "model": cfg.model,
        "model_path": None if cfg.model_path is None else str(cfg.model_path),
        "device": str(device),
        "dtype": dtype,
        "layout": cfg.layout.to_json(),
        "attention_backend": attention_backend,
        "started_at": started,
        "wall_s": round(wall_s, 6),
        "counts": counts,
        "peak_memory_bytes": max(rank_peaks),
        "peak_memory_source": peak_source,
        "per_rank_peak_memory_bytes": rank_peaks,
        "versions": versions(),
        # The effective options: `ditango generate --config report.json` runs the same again.
        "options": cfg.options,
        "layout_choice": cfg.layout_choice,  # --layout auto: what the layout search chose, and why
        "items": records,
    }


@dataclass
class ReportWriter:
    """A rank's run report, rewritten (by the writer) after every item so that an interrupted
    batch still has an up-to-date one. `records`: every item's record so far, by id."""

    cfg: RunConfig
    path: Path
    device: torch.device
    dtype: str
    attention_backend: str
    records: dict[str, dict]
    weights: dict = field(default_factory=lambda: {"shard_degree": 1})  # the transformers' and text encoder's
    calibration: dict | None = None  # --target-psnr: the chosen cache ratio and its trials
    step_cache_calibration: dict | None = None  # --step-cache magcache without mag_ratios: measured on item 1
    timing: RunTiming | None = None  # a run that started a rank (None: settled without one)
    compiled: CompileRecord = field(default_factory=CompileRecord)  # --compile (runtime/compile.py)
    quantized: dict | None = None  # --quantize: what was quantized (runtime/quantize.py)
    queue: dict | None = None  # the shared queue's workers as they stand (runtime/queue_status.py)
    started: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    wall_start: float = field(default_factory=time.perf_counter)

    def write(self, rank_peaks: list[int] | None = None) -> dict:
        """Write the report (`rank_peaks`: every rank's peak memory, at the end; else this one's)."""
        peak, source = peak_memory(self.device)
        ordered = [self.records[i.id] for i in self.cfg.items if i.id in self.records]
        report = run_report(
            self.cfg,
            ordered,
            self.device,
            self.dtype,
            self.started,
            time.perf_counter() - self.wall_start,
            attention_backend=self.attention_backend,
            rank_peaks=rank_peaks or [peak],
            peak_source=source,
        )
        report["weights"] = self.weights
        if self.calibration is not None:
            report["calibration"] = self.calibration
        if self.step_cache_calibration is not None:
            report["step_cache_calibration"] = self.step_cache_calibration
        report["compile"] = self.compiled.to_json()
        report["quantize"] = self.quantized
        if self.queue is not None:
            report["queue"] = self.queue
        if self.timing is not None:
            self.timing.compile_s = self.compiled.compile_s
            report["timing"] = self.timing.to_json(self.records)
        if (profile := profile_summary(ordered)) is not None:
            report["profile"] = profile
        write_json(self.path, report)
        if self.path == self.cfg.out_dir / "report.json":  # a task's or replica's own report has no page
            write_gallery(self.cfg.out_dir, report)
        return report
