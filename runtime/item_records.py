"""What an item's record gathers from every rank after its steps: the bytes each moved,
DiTango's plan (the same on every rank), the step cache's decisions (the same on the ranks of
a branch), Hybridiff's stages, and whether the latents are finite everywhere."""

from __future__ import annotations

import torch

from runtime.config import Item
from runtime.context import RankContext
from runtime.denoiser import Denoiser
from runtime.loop_types import DenoiseResult, NonFiniteLatents


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


def hybrid_record(denoiser: Denoiser, ctx: RankContext) -> dict | None:
    """Hybridiff's record: each rank's block evaluations per step, the bytes of each stage summed."""
    hybrid = denoiser.guidance.record()
    if hybrid is None:
        return None
    hybrid["block_evals"] = ctx.gather(hybrid["block_evals"])  # [rank][step]
    stage_bytes = ctx.gather(hybrid.pop("bytes_per_stage"))
    hybrid["bytes_per_stage"] = {s: sum(r.get(s, 0) for r in stage_bytes) for s in sorted(set().union(*stage_bytes))}
    return hybrid


def gathered_records(denoiser: Denoiser, ctx: RankContext) -> dict:
    """The parts of the item's record every rank contributes to, after its steps (collectives:
    every rank calls it): bytes moved, DiTango's plan, the step cache's decisions, Hybridiff's stages."""
    return {
        "comm": sum_comm(ctx.gather(ctx.comm.totals())),
        "attention": attention_record(denoiser, ctx),
        "step_cache": step_cache_record(denoiser, ctx),
        "hybrid": hybrid_record(denoiser, ctx),
    }
