"""A rank's bring-up for a run: the model resolved, loaded (its LoRA sets banked), its weights
sharded, the strategy installed (runtime/assembly.py) and the calibrations run. What it hands
the item loop (runtime/run.py) is one `Running`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from planner.precision import check_fp8_device
from runtime.assembly import build_denoiser, host_loaded
from runtime.calibrate import step_cache_ratios, target_quality
from runtime.compile import compile_blocks
from runtime.config import Item, RunConfig
from runtime.context import RankContext
from runtime.denoiser import Denoiser
from runtime.memory_plan import plan_memory
from runtime.models.adapters import adapter_sets, same_weights
from runtime.models.loading import load_components
from runtime.models.resolve import resolve_model
from runtime.quantize import Quantized, quantize_transformers
from runtime.report import ReportWriter
from runtime.weights import SHARDED, local_param_bytes, shard_weights


@dataclass
class Running:
    """What the item loop reads: the run's settings as the bring-up left them (the memory
    re-plan, --target-psnr's cache ratio), the denoiser, the LoRA bank (None: no LoRA), the
    items in the order they run (a LoRA set at a time), and the first item's exact latents
    where a calibration computed them."""

    cfg: RunConfig
    denoiser: Denoiser
    bank: object | None
    todo: list[Item]
    first_reference: torch.Tensor | None = None


def bring_up(
    cfg: RunConfig,
    ctx: RankContext,
    placement,
    backend: str,
    todo: list[Item],
    report: ReportWriter,
    message,
    report_name: str,
) -> Running:
    """Load and prepare everything `todo` needs on this rank; `report` records the weights and
    the times (model_load_s, calibration_s) and the calibrations' results."""
    started = time.perf_counter()
    resolved = resolve_model(cfg.model if cfg.model_path is None else str(cfg.model_path))
    if placement.device.type == "cuda" and cfg.gpu_memory is None:  # submitted without a GPU to ask
        total = torch.cuda.get_device_properties(placement.device).total_memory
        cfg = plan_memory(cfg, resolved.spec.shape, total, placement.dtype.itemsize, cfg.model)
    sets = adapter_sets(todo)
    todo = sorted(todo, key=lambda item: sets.index(item.loras))  # a set at a time: the model loaded once
    components = load_components(resolved, placement, on_cpu=run_host_loaded(cfg, ctx), adapter_sets=sets)
    bank = components.pop("adapters", None)
    if bank is not None:
        same_weights(components, ctx)
        report.weights.update(model_loads=1, adapter_sets=len(sets), adapters_fused=bank.fused)
    quantized = quantize_for_run(cfg, components, placement.device)  # after the LoRA fusion, before FSDP
    report.quantized = None if quantized is None else quantized.report()
    if cfg.shard_weights and ctx.distributed:
        report.weights["shard_degree"] = shard_weights(components, ctx.mesh, placement.device)
    denoiser = denoiser_for_run(cfg, ctx, resolved.spec, components, placement, backend)
    denoiser.quantized = quantized
    if cfg.compile:  # the strategy installed: its ops are what the blocks call
        compile_blocks(denoiser.transformers, report.compiled)
    report.weights["param_bytes_per_rank"] = sum(local_param_bytes(components[n]) for n in SHARDED if n in components)
    calibrating = time.perf_counter()
    report.timing.model_load_s = calibrating - started
    running = calibrate(Running(cfg, denoiser, bank, todo), ctx, report, message, report_name)
    report.timing.calibration_s = time.perf_counter() - calibrating
    return running


def calibrate(running: Running, ctx: RankContext, report: ReportWriter, message, report_name: str) -> Running:
    """A magcache step cache without its ratios measures them on the first item, and
    --target-psnr chooses the cache ratio there (each keeps that item's exact latents)."""
    denoiser, cfg, first = running.denoiser, running.cfg, running.todo[0]
    if denoiser.step_cache is not None and denoiser.step_cache.needs_calibration:
        report.step_cache_calibration, running.first_reference = step_cache_ratios(
            denoiser, first, cfg, ctx, message, report_name
        )
    if cfg.ditango is not None and cfg.ditango.target_psnr is not None:
        running.cfg, report.calibration, running.first_reference = target_quality(
            denoiser, first, cfg, ctx, message, report_name
        )
    return running


def quantize_for_run(cfg: RunConfig, components: dict, device: torch.device) -> Quantized | None:
    """--quantize on the transformers, loaded on the CPU (`run_host_loaded`): each layer is
    quantized on `device` (so that it never holds the whole unquantized model; under
    --shard-weights they stay on the CPU, for FSDP to shard). The originals are kept for
    --reference exact."""
    if cfg.quantize == "none":
        return None
    if device.type == "cuda":  # a submission's GPU, known only here (a local run's was asked before)
        check_fp8_device(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    transformers = [components[n] for n in ("transformer", "transformer_2") if components.get(n) is not None]
    on = torch.device("cpu") if cfg.shard_weights else device
    return quantize_transformers(transformers, keep_original=cfg.reference == "exact", device=on)


def denoiser_for_run(cfg: RunConfig, ctx: RankContext, spec, components: dict, placement, backend: str) -> Denoiser:
    """The rank's denoiser over loaded `components`, as `cfg` asks (runtime/assembly.py)."""
    split = "transformer" in run_host_loaded(cfg, ctx) and not cfg.shard_weights
    return build_denoiser(
        components,
        placement,
        cfg.max_text_len,
        variant=spec.variant,
        mesh=ctx.mesh,
        comm=ctx.comm,
        backend=backend,
        ditango=cfg.ditango,
        step_cache=cfg.step_cache,
        hybrid=cfg.hybrid,
        split_on_host=split,
    )


def run_host_loaded(cfg: RunConfig, ctx: RankContext) -> tuple[str, ...]:
    """What `cfg` loads onto the CPU first on this rank (runtime/assembly.py's `host_loaded`)."""
    return host_loaded(cfg.layout.strategy, cfg.shard_weights, ctx.distributed, cfg.quantize)
