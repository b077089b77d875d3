"""Every top-level field of report.json and of an item's record (its sidecar `<id>.json`, and
its entry in the report's `items`), with what it holds: the schema the manual prints
(docs/report-json.md's table is generated from here) and the tests hold written files to (no
field written that is not listed; every field listed as always there is)."""

from __future__ import annotations

# name: (always there, what it holds)
ITEM_FIELDS: dict[str, tuple[bool, str]] = {
    "schema": (True, "1: the record format"),
    "id": (True, "the item's id: its files are `<id>.mp4`, `<id>.json`, ..."),
    "status": (True, "done, skipped, failed or running (written when a --queue static launch starts it)"),
    "model": (True, "the model as the run named it"),
    "prompt": (True, "the prompt"),
    "negative_prompt": (True, "the negative prompt"),
    "seed": (True, "the seed of the initial latents (the same on every rank and layout)"),
    "frames": (True, "frames of the video"),
    "height": (True, "pixels"),
    "width": (True, "pixels"),
    "steps": (True, "denoising steps"),
    "guidance": (True, "the CFG scale (HunyuanVideo: the embedded guidance)"),
    "guidance_2": (True, "two-expert models: the low-noise expert's scale (null: `guidance`)"),
    "true_cfg_scale": (True, "HunyuanVideo: the real CFG scale"),
    "image": (True, "image-to-video: the conditioning image"),
    "loras": (True, "LoRA adapters: source, scale, expert, file and its sha256"),
    "scheduler": (True, "the solver it ran"),
    "flow_shift": (True, "the solver's flow shift"),
    "fps": (True, "the MP4's frame rate"),
    "tokens": (True, "the transformer's sequence length"),
    "video": (True, "the MP4, relative to the output folder (null until written)"),
    "latents": (True, "with --save-latents: the final latents (safetensors), relative"),
    "timing": (True, "total_s, text_encode_s, denoise_s, decode_s, write_s, step_s per step; reference_s"),
    "comm": (True, "bytes received, summed over ranks, by link class and by purpose"),
    "attention": (True, "computed_fraction_all_steps; under DiTango its plan and reuse verdict"),
    "quality": (True, "--reference exact: psnr, ssim, latent_rel_err against the exact run"),
    "step_cache": (True, "--step-cache: its options, the blocks and attention layers evaluated per step"),
    "hybrid": (True, "--hybrid: tau1, tau2, rel_mae and stage per step, block evaluations, bytes per stage"),
    "decode": (True, "mode (tiled or untiled), tiles, ranks, per_rank_s, bytes; psnr_vs_untiled"),
    "method": (True, "what else shaped the video ({}: an exact run): a folder resumes only under the same"),
    "profile": (True, "--profile: per rank, ms per profiled step by category, and the traces"),
    "audio": (
        True,
        "a model with an audio track (LTX-2): its latents' shape; muxed, codec, sample_rate, channels, "
        "seconds, decode_s, or why not (--no-audio)",
    ),
    "guidance_terms": (
        True,
        "LTX-2: the pipeline's guidance beyond the CFG scale (audio CFG, STG, modality, "
        "rescale) and the shift's mu from the whole video's tokens",
    ),
    "error": (True, "a failed item's error, one line"),
    "attempts": (False, "a retried or failed item: the launches that ran it"),
    "final": (False, "a failed item that no rerun retries (its failure was not the launch's)"),
    "poster": (False, "the poster frame (PNG) report.html shows"),
    "steps_png": (False, "the per-step plot report.html shows"),
    "video_sha256": (False, "the MP4's SHA-256: whose video was published"),
    "queue": (
        False,
        "made from the shared queue: batch, token (the lease's fencing token), worker and label (who made it)",
    ),
}

RUN_FIELDS: dict[str, tuple[bool, str]] = {
    "schema": (True, "1: the record format"),
    "model": (True, "the model as the run named it"),
    "model_path": (True, "the folder it was loaded from (null: built in)"),
    "device": (True, "cpu or cuda"),
    "dtype": (True, "the transformer's dtype"),
    "layout": (True, "world_size, nodes, gpus_per_node, cfg_degree, cp_degree, strategy and its degrees"),
    "attention_backend": (
        True,
        "the attention kernel that ran: sdpa, flash, flash3 or reference (one rank a branch: in diffusers' attention)",
    ),
    "started_at": (True, "UTC, ISO 8601"),
    "wall_s": (True, "seconds from the start to this write"),
    "counts": (True, "items done, skipped and failed"),
    "peak_memory_bytes": (True, "the largest of per_rank_peak_memory_bytes"),
    "peak_memory_source": (True, "cuda_max_memory_allocated, or process_max_rss on CPU"),
    "per_rank_peak_memory_bytes": (True, "each rank's peak"),
    "versions": (True, "ditango, torch, diffusers, python"),
    "options": (True, "the effective options: `ditango generate --config report.json` runs the same again"),
    "layout_choice": (True, "--layout auto: what the layout search chose, and why"),
    "items": (True, "every item's record, in the batch's order"),
    "weights": (True, "how the weights were held: shard_degree (FSDP2 over the cp group)"),
    "compile": (
        True,
        "--compile: enabled, blocks (the repeated blocks compiled), compiles (graphs made), fallback (null, or "
        "why it ran eager)",
    ),
    "quantize": (
        True,
        "--quantize: null (none), or format (fp8_e4m3), layers and weights quantized, skipped_layers",
    ),
    "timing": (
        False,
        "bring_up_s, model_load_s, calibration_s, items_s, compile_s (--compile: the block calls that"
        " compiled, part of items_s), decode_s, write_s, items",
    ),
    "calibration": (False, "--target-psnr: the cache ratio chosen, its trials, recalibrations"),
    "step_cache_calibration": (False, "--step-cache magcache without mag_ratios: the ratios measured"),
    "profile": (False, "--profile: the per-rank mean over the items, weighted by profiled steps"),
    "aggregated_from": (False, "`ditango report` or a batch of tasks: the task and replica reports merged"),
    "queue": (
        False,
        "the shared queue: batch, lease_s, workers (label, host, pid, launch, job, state, done, failed) and "
        "discarded (the late files of leases taken over)",
    ),
}


def field_table(fields: dict[str, tuple[bool, str]]) -> str:
    """Markdown: a table of `fields`."""
    rows = ["| field | always | what it holds |", "|---|---|---|"]
    rows += [f"| `{name}` | {'yes' if always else 'no'} | {what} |" for name, (always, what) in fields.items()]
    return "\n".join(rows)
