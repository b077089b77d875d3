"""Attention locality of a model: how much softmax mass a query puts on nearby keys.

    .venv/bin/python benchmarks/locality.py [--model tiny-wan] [--prompts 8] [--steps 25]
                                            [--partitions 8] [--out FILE.md]

Context parallelism cuts the token sequence into P contiguous partitions, one per rank;
DiTango rests on the observation that a query's own and adjacent partitions carry most of
its attention while far ones carry little. This measures it: the model generates each
prompt (exact attention, guidance as the model's default), and every self-attention call
of every step records, per layer, the share of softmax mass that queries of partition i
put on keys of partition i ("own"), i +- 1 ("adjacent") and the rest ("far"), averaged
over queries, heads, steps, CFG branches and prompts. The uniform-attention shares are
printed alongside: mass above them is locality. A table per denoising phase (first and
last third of the steps) shows whether locality changes as the video takes shape.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.layout import chunk_sizes  # noqa: E402
from runtime.denoiser import Denoiser  # noqa: E402
from runtime.models.loading import load_components, resolve_placement  # noqa: E402
from runtime.models.resolve import resolve_model  # noqa: E402
from runtime.models.wan import apply_rotary  # noqa: E402
from tiny_wan.data import eval_prompts  # noqa: E402


class LocalityRecorder:
    """Self-attention processor: records the partition-to-partition softmax mass, then defers
    to the model's own processor for the output (so generation is unchanged)."""

    def __init__(self, inner, layer: int, stats: dict, partitions: int) -> None:
        self.inner, self.layer, self.stats, self.partitions = inner, layer, stats, partitions
        self.phase = "all"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        with torch.no_grad():
            q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, S, H, D]
            k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
            if rotary_emb is not None:
                q, k = apply_rotary(q, *rotary_emb), apply_rotary(k, *rotary_emb)
            probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1]), -1)
            sizes = chunk_sizes(probs.shape[-1], self.partitions)
            part = torch.repeat_interleave(torch.arange(self.partitions), torch.tensor(sizes))
            onehot = torch.nn.functional.one_hot(part, self.partitions).to(probs.dtype)  # [S, P]
            per_query = probs @ onehot  # [B, H, S, P]: mass of each query on each key partition
            distance = (part.view(-1, 1) - torch.arange(self.partitions).view(1, -1)).abs()  # [S, P]
            shares = torch.stack(
                [
                    (per_query * (distance == 0)).sum(-1),
                    (per_query * (distance == 1)).sum(-1),
                    (per_query * (distance > 1)).sum(-1),
                ],
                dim=-1,
            )
            mean = shares.mean(dim=(0, 1, 2))  # own, adjacent, far
            for phase in ("all", self.phase):
                acc = self.stats.setdefault((phase, self.layer), [torch.zeros(3, dtype=torch.float64), 0])
                acc[0] += mean.double()
                acc[1] += 1
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def uniform_shares(tokens: int, partitions: int) -> tuple[float, float, float]:
    """Shares under uniform attention (every key equally likely), same partitioning."""
    sizes = chunk_sizes(tokens, partitions)
    own = adj = 0.0
    for i, n in enumerate(sizes):
        own += n * n
        adj += n * sum(sizes[j] for j in (i - 1, i + 1) if 0 <= j < partitions)
    total = tokens * tokens
    return own / total, adj / total, 1 - (own + adj) / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-wan")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="default: the model's")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = ap.parse_args()
    import diffusers.utils.logging

    diffusers.utils.logging.disable_progress_bar()

    resolved = resolve_model(args.model)
    d = resolved.spec.defaults
    steps = args.steps or d.steps
    placement = resolve_placement("auto")
    denoiser = Denoiser(load_components(resolved, placement), placement, d.max_text_len)
    stats: dict = {}
    recorders = []
    for layer, block in enumerate(denoiser.transformer.blocks):
        rec = LocalityRecorder(block.attn1.processor, layer, stats, args.partitions)
        block.attn1.set_processor(rec)
        recorders.append(rec)

    def on_step(step: int, total: int) -> None:  # the phase of the *next* step
        phase = "early" if step < total / 3 else ("late" if step >= total - total / 3 else "middle")
        for rec in recorders:
            rec.phase = phase

    tokens = 0
    for prompt in eval_prompts(args.prompts):
        on_step(0, steps)
        text = denoiser.encode_text(prompt.caption, d.negative_prompt, d.guidance)
        latents = denoiser.initial_latents(0, d.height, d.width, d.frames)
        f, h, w = latents.shape[2:]
        p = denoiser.transformer.config.patch_size
        tokens = (f // p[0]) * (h // p[1]) * (w // p[2])
        denoiser.denoise(latents, text, steps, d.guidance, on_step=on_step)

    uni = uniform_shares(tokens, args.partitions)
    lines = [
        f"Attention locality of `{args.model}`: {args.prompts} prompts, {steps} steps, guidance {d.guidance:g}, "
        f"{d.width}x{d.height}x{d.frames} ({tokens} tokens), keys in {args.partitions} contiguous partitions.",
        "",
    ]
    for phase, title in (("all", "all steps"), ("early", "first third of the steps"), ("late", "last third")):
        lines += [f"**{title}**", "", "| layer | own | adjacent | far |", "|---|---:|---:|---:|"]
        rows = []
        for layer in range(len(recorders)):
            total, n = stats[(phase, layer)]
            own, adj, far = (total / n).tolist()
            rows.append((own, adj, far))
            lines.append(f"| {layer} | {own:.1%} | {adj:.1%} | {far:.1%} |")
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(3)]
        lines.append(f"| mean | {mean[0]:.1%} | {mean[1]:.1%} | {mean[2]:.1%} |")
        lines += [f"| uniform | {uni[0]:.1%} | {uni[1]:.1%} | {uni[2]:.1%} |", ""]
        if phase == "all":
            near, near_uni = mean[0] + mean[1], uni[0] + uni[1]
            verdict = "near partitions dominate" if near > 0.5 else "near partitions do not dominate"
            lines.insert(
                2,
                f"Own + adjacent partitions carry {near:.1%} of the softmax mass on average "
                f"(uniform attention: {near_uni:.1%}): {verdict}.\n",
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
