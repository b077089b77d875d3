"""A rehearsal of one item's rank program at the real model's shapes, without a GPU.

Each rehearsed rank runs what `execute` runs for one item (load, text encode, a sample of the
denoising steps, the decode; not the MP4) as rank r of the real layout: the modules are built
from their configs on the meta device (runtime/models/meta.py) and placed on fake CUDA
tensors (`FakeTensorMode`: shape, dtype and device, no data), and the process groups are
torch's `fake` backend (collectives return at once). Four observers watch it:

- memory: torch's `MemTracker` per phase (load, encode, denoise, decode), against the memory
  model's figure for the same phase and rank (planner/memory.py);
- collectives: every c10d op, its bytes received by this rank by link class (intra- or
  inter-node), per denoising step, against planner/traffic.py for the same plan;
- problems: an op on another device than the rank's GPU (or a device mix), a matrix product,
  convolution or attention in a dtype the configuration does not give that module, float64 on
  the GPU, a large computation on the CPU, an exception;
- host reads: `.item()`, `int()`, `bool()`, `.tolist()` of a tensor, by call site and device
  (of a GPU tensor: a wait for the GPU on a real run). A rehearsal has no values: such a
  read returns True for a bool, 0 otherwise. Where a value decides a shape or a plan, the
  rehearsal supplies it instead: DiTango's plan replays the recorded plan shape simulate uses
  (planner/plan_shape.py), the expert schedule comes from a real scheduler on the host, and
  text masks count every token valid (the longest prompt, as the memory model assumes; a mask
  of unknown values selects every element, a filled one all or none: known.py).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist

from planner.decode_memory import decode_bytes
from planner.layout import virtual_node_map
from planner.memory import GIB, estimate_memory
from planner.plan import StepPlan
from runtime.config import RunConfig
from runtime.memory_plan import item_memory_options
from runtime.rehearse.fake_gpu import (
    CONSTANT_LIMIT,
    fake_cuda,
    fake_module_to,
    gpu_sdpa,
    inference_tracker,
    move_fake_states,
    tile_shapes,
)
from runtime.rehearse.replay import rehearsed_ranks, replay_on, replayed_plans, sample_steps
from runtime.rehearse.watch import NOT_SITES, OURS, ROOT, StepBytes, Watch

__all__ = ["inference_tracker", "rehearse"]

PHASES = ("load", "encode", "denoise", "decode")
MODEL_PHASE = {"encode": "text_encode", "denoise": "denoise", "decode": "decode"}
TOLERANCE = 0.15  # a rank's traced against its modelled peak: more apart than this is a problem


def modelled_phases(cfg: RunConfig, shape, rank: int, dtype_bytes: int) -> dict[str, int]:
    """The memory model's bytes of each phase on `rank` for the first item (the writer decodes
    alone unless the decode is parallel; the others hold only what stays)."""
    size, options = next(item_memory_options(replace(cfg, items=cfg.items[:1]), dtype_bytes))
    options = replace(
        options, offload_text_encoder="text_encoder" in cfg.offload, offload_transformer="transformer" in cfg.offload
    )
    est = estimate_memory(shape, cfg.layout, size, options)
    nccl = est.stages["nccl"]  # NCCL's buffers: estimated, a fake process group has none to trace
    phases = {"load": est.phases["load"] - nccl, **{p: est.phases[m] - nccl for p, m in MODEL_PHASE.items()}}
    decode = est.resident["decode"].get("vae_decode", 0)
    if options.vae_parallel and shape.vae is not None:  # this rank's tiles (the writer: all of them, blended)
        latent = shape.latent_shape(size)
        phases["decode"] += decode_bytes(shape.vae, latent, True, options.tile_px, cfg.layout.world_size, rank) - decode
    elif rank != 0:
        phases["decode"] -= decode
    return phases


def modelled_step_bytes(
    cfg: RunConfig, shape, rank: int, plan: StepPlan | None, dtype_bytes: int, roots: int = 0, step: int = 0
) -> dict:
    """planner/traffic.py's bytes received by `rank` in one step of `plan` (None: exact); `roots`:
    transformers whose first forward it is (FSDP gathers their root units then)."""
    from planner.traffic import predict_traffic

    item = cfg.items[0]
    guidance = item.cfg_scale > 1
    extra = {}
    if plan is not None:
        forwards = 1 if cfg.layout.cfg_degree == 2 else (2 if guidance else 1)
        planner = cfg.ditango.planner
        extra = {
            "plan_bits": [plan.compute_LU.tolist()] * forwards,
            "plan_kinds": [plan.kind],
            "own_group": planner.own_group,
            "planner": planner.planner,
        }
    return predict_traffic(
        cfg.layout,
        shape,
        item.size,
        1,
        guidance=guidance,
        element_bytes=dtype_bytes,
        rank=rank,
        shard_weights=cfg.shard_weights,
        roots=roots,
        step_cache=None if cfg.step_cache is None else cfg.step_cache.name,
        first_step=step == 0,
        **extra,
    )


def _on_component(watch: Watch, components: dict) -> None:
    """Tell `watch` which component's forward runs (the dtype it is configured for)."""
    for name, module in components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        watch.keep_float32 |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        module.register_forward_pre_hook(lambda m, a, name=name: setattr(watch, "component", name))
        module.register_forward_hook(lambda m, a, o: setattr(watch, "component", None))


def rehearse_rank(
    cfg: RunConfig,
    spec,
    path,
    rank: int,
    gpu_bytes: int,
    steps_run: list[int],
    plans: dict[int, StepPlan] | None,
    experts: list[int],
) -> dict:
    """One rank's rehearsal (see the module doc): its report."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.distributed.fsdp._fully_shard import _fsdp_init as fsdp_init
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import runtime.assembly as assembly
    import runtime.denoiser as denoiser_module
    import runtime.vae as vae_module
    import runtime.weights as weights_module
    from runtime.bring_up import denoiser_for_run, quantize_for_run, run_host_loaded
    from runtime.comm import Comm
    from runtime.context import RankContext
    from runtime.inputs import item_inputs
    from runtime.kernels import passes_attention_mask, resolve_backend
    from runtime.mesh import build_mesh
    from runtime.models.families import FAMILIES
    from runtime.models.loading import placement_on
    from runtime.models.meta import materialize, meta_components
    from runtime.run import before_decode
    from runtime.vae import decode_video
    from runtime.weights import shard_weights

    layout, item = cfg.layout, cfg.items[0]
    node_of = virtual_node_map(layout)
    device = torch.device("cuda", rank % layout.gpus_per_node)
    placement = placement_on(device, cfg.dtype)
    dtype = placement.dtype
    expected = {
        "transformer": dtype,
        "transformer_2": dtype,
        "text_encoder": dtype,
        "text_encoder_2": dtype,
        "vae": torch.float32,
        "image_encoder": torch.float32,
    }
    watch = Watch(rank, device, node_of, expected)
    tracker = inference_tracker()
    traced: dict[str, int] = {}

    def allocated() -> int:
        return tracker.get_tracker_snapshot().get(device, {}).get("Total", 0)

    @contextlib.contextmanager
    def phase(name: str):
        watch.phase = name
        with tracker:
            yield
        traced[name] = tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)

    shapes: dict = {}  # the item's latents' shape: a schedule shifted by the video's size (LTX-2) reads it

    def real_timesteps(scheduler) -> list[float]:
        with unset_fake_temporarily(), mock.patch.object(denoiser.model, "device", torch.device("cpu")):
            latents = torch.empty(shapes["latents"], device="meta")
            return denoiser.new_scheduler(len(scheduler.timesteps), None, latents).timesteps.tolist()

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    error = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(fake_cuda(layout.gpus_per_node, device.index, gpu_bytes, allocated))
            watch.modules = stack.enter_context(ModTracker())
            stack.enter_context(watch)
            stack.enter_context(mock.patch.object(denoiser_module, "host_timesteps", real_timesteps))
            stack.enter_context(mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", CONSTANT_LIMIT))
            stack.enter_context(mock.patch.object(fsdp_init, "_move_states_to_device", move_fake_states))
            for family in FAMILIES.values():  # a text mask read on the host: no values here, every token valid
                if hasattr(family, "valid_text_tokens"):
                    stack.enter_context(mock.patch.object(family, "valid_text_tokens", lambda mask_L: mask_L.shape[0]))
            stack.enter_context(mock.patch.object(vae_module, "tile_shapes", tile_shapes))
            # an offloaded component's moves (runtime/weights.py place): nn.Module.to would swap
            # fake tensors the memory trackers still reference
            stack.enter_context(mock.patch.object(weights_module, "move_module", fake_module_to))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", gpu_sdpa(sdpa)))
            stack.enter_context(
                mock.patch.object(Comm, "gather_objects", lambda self, obj, group, ranks: [obj] * len(ranks))
            )
            stack.enter_context(mock.patch.object(Comm, "broadcast_object", lambda self, obj, src, group: obj))
            try:
                with phase("load"):
                    mesh = build_mesh(layout, rank, node_of, cfg.timeout_s, device, control_backend="fake")
                    ctx = RankContext(mesh, Comm(mesh))
                    components = meta_components(spec, path, dtype, cfg.max_text_len)
                    on_cpu = run_host_loaded(cfg, ctx)
                    for name, module in components.items():
                        if isinstance(module, torch.nn.Module):
                            materialize(module, torch.device("cpu") if name in on_cpu else device)
                    one_rank = layout.strategy.runtime is None
                    masked = one_rank and passes_attention_mask(spec.family)
                    backend = resolve_backend(cfg.attention_backend, device, dtype, one_rank=one_rank, masked=masked)
                    # modules moved to the GPU as for fake tensors (see move_fake_states)
                    with (
                        mock.patch.object(torch.nn.Module, "to", fake_module_to),
                        mock.patch.object(assembly, "move_unsplit", fake_module_to),
                    ):
                        quantized = quantize_for_run(cfg, components, device)
                        if cfg.shard_weights and ctx.distributed:
                            shard_weights(components, mesh, device)
                        denoiser = denoiser_for_run(cfg, ctx, spec, components, placement, backend)
                        denoiser.quantized = quantized
                    _on_component(watch, components)
                    listener = denoiser.listener
                    if denoiser.ditango is not None:
                        replay_on(denoiser.ditango, plans)
                with phase("encode"):
                    text, latents, condition = item_inputs(denoiser, item, cfg)
                    shapes["latents"] = tuple(latents.shape)
                with phase("denoise"):
                    watch.step = steps_run[0] if listener is None else None
                    if listener is not None:
                        begin = listener.begin_step
                        listener.begin_step = lambda i: (setattr(watch, "step", i), begin(i))[1]

                    def step_done(done: int, steps: int) -> None:
                        later = [s for s in steps_run if s >= done]
                        watch.step = later[0] if listener is None and later else None

                    result = denoiser.denoise(
                        latents,
                        text,
                        item.steps,
                        item.cfg_scale,
                        on_step=step_done,
                        condition=condition,
                        guidance_2=item.guidance_2,
                        run_steps=frozenset(steps_run),
                        sampler=item.sampler,
                    )
                with phase("decode"):
                    options = before_decode(denoiser, cfg, ctx)
                    if options is not None:
                        decode_video(denoiser.vae, denoiser.vae_input(result.latents_BCFHW), options, ctx)
            except Exception as exc:  # what a real run would have raised on this rank
                error = exc
                frames = [
                    f
                    for f in traceback.extract_tb(exc.__traceback__)
                    if f.filename.startswith(OURS) and not f.filename.startswith(NOT_SITES)
                ]
                where = f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else "?"
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                watch.problems[f"{type(exc).__name__}: {first} at {where} ({watch.phase})"] += 1
    finally:
        dist.destroy_process_group()
    return rank_report(cfg, spec, rank, traced, watch, plans, steps_run, dtype.itemsize, error is not None, experts)


def rank_report(
    cfg, spec, rank, traced, watch: Watch, plans, steps_run, dtype_bytes, failed: bool, experts: list[int]
) -> dict:
    modelled = modelled_phases(cfg, spec.shape, rank, dtype_bytes)
    phases = {}
    for name in PHASES:
        if name not in traced:
            continue
        t, m = traced[name], modelled[name]
        phases[name] = {"traced_bytes": t, "modelled_bytes": m, "ratio": round(t / m, 4) if m else None}
    steps = []
    for step in steps_run:
        got = watch.steps.get(step, StepBytes())
        plan = plans.get(step) if plans else None
        first = step == next(s for s in steps_run if experts[s] == experts[step])  # the expert's first forward
        model = modelled_step_bytes(cfg, spec.shape, rank, plan, dtype_bytes, roots=int(first), step=step)
        steps.append(
            {
                "step": step,
                "kind": plan.kind if plan else "exact",
                "intra_node_bytes": got.intra_node_bytes,
                "inter_node_bytes": got.inter_node_bytes,
                "modelled_intra_node_bytes": model["intra_node_bytes"],
                "modelled_inter_node_bytes": model["inter_node_bytes"],
                "collectives": dict(sorted(got.collectives.items())),
            }
        )
    problems = [f"{what}" + (f" ({n} times)" if n > 1 else "") for what, n in sorted(watch.problems.items())]
    peak = None
    if phases and not failed:  # the rank's peak, over its phases, is what the pre-flight budgets
        traced_peak = max(p["traced_bytes"] for p in phases.values())
        modelled_peak = max(p["modelled_bytes"] for p in phases.values())
        peak = {
            "traced_bytes": traced_peak,
            "modelled_bytes": modelled_peak,
            "ratio": round(traced_peak / modelled_peak, 4) if modelled_peak else None,
        }
        if peak["ratio"] is None or abs(peak["ratio"] - 1) > TOLERANCE:
            problems.append(
                f"traced peak {traced_peak / GIB:.2f} GiB, the memory model says "
                f"{modelled_peak / GIB:.2f} GiB ({peak['ratio']}x)"
            )
    if not failed:
        for s in steps:
            for link in ("intra_node_bytes", "inter_node_bytes"):
                if s[link] != s[f"modelled_{link}"]:
                    problems.append(
                        f"step {s['step']} ({s['kind']}): {s[link]} {link.replace('_', ' ')} received, "
                        f"planner/traffic.py counts {s[f'modelled_{link}']}"
                    )
    count = max(1, len(steps))
    return {
        "rank": rank,
        "node": virtual_node_map(cfg.layout)[rank],
        "phases": phases,
        "peak": peak,
        "bytes_per_step": {k: sum(s[k] for s in steps) // count for k in ("intra_node_bytes", "inter_node_bytes")},
        "modelled_bytes_per_step": {
            k: sum(s[f"modelled_{k}"] for s in steps) // count for k in ("intra_node_bytes", "inter_node_bytes")
        },
        "steps": steps,
        "host_reads": [
            {"phase": p, "device": d, "site": site, "count": n} for (p, d, site), n in sorted(watch.reads.items())
        ],
        "problems": problems,
    }


def rehearse(cfg: RunConfig, spec, path, gpu_bytes: int, all_ranks: bool = False, on_rank=None) -> dict:
    """Rehearse the first item of `cfg` on the ranks whose shapes differ (all with
    `all_ranks`); `on_rank(report)` after each. The report `ditango rehearse --json` prints."""
    from runtime.denoiser import switch_steps

    item = cfg.items[0]
    experts = [0] * item.steps
    if spec.variant.experts == 2:
        from runtime.models.families import FAMILIES
        from runtime.models.meta import meta_scheduler

        scheduler = meta_scheduler(spec, path)
        scheduler.set_timesteps(item.steps, device="cpu")
        experts = FAMILIES[spec.family].expert_schedule(
            spec.variant, scheduler.timesteps.tolist(), scheduler.config.num_train_timesteps
        )
    switches = switch_steps(experts)
    plans = None
    if cfg.ditango is not None:
        plans = replayed_plans(cfg, spec.layers, item.steps, switches)
    steps_run = sample_steps(plans, item.steps, switches)
    reports = []
    for rank in rehearsed_ranks(cfg, all_ranks):
        reports.append(rehearse_rank(cfg, spec, path, rank, gpu_bytes, steps_run, plans, experts))
        if on_rank is not None:
            on_rank(reports[-1])
    totals = None
    if len(reports) == cfg.layout.world_size:
        totals = {k: sum(r["bytes_per_step"][k] for r in reports) for k in ("intra_node_bytes", "inter_node_bytes")}
    return {
        "model": cfg.model,
        "item": {
            "height": item.height,
            "width": item.width,
            "frames": item.frames,
            "steps": item.steps,
            "tokens": item.tokens(),
        },
        "layout": cfg.layout.to_json(),
        "gpu_memory_bytes": gpu_bytes,
        "offload": list(cfg.offload),
        "steps_rehearsed": [{"step": s, "kind": plans[s].kind if plans else "exact"} for s in steps_run],
        "ranks": reports,
        "bytes_per_step_all_ranks": totals,
        "problems": sorted({f"rank {r['rank']}: {p}" for r in reports for p in r["problems"]}),
    }
