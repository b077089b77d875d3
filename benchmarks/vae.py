"""VAE decode time and memory on 1, 2 and 4 ranks, tiled and untiled (runtime/vae.py).

    .venv/bin/python benchmarks/vae.py [--height 320 --width 320 --frames 9] [--tile 128] [--vae wan2.1]

One latent video, decoded in one run by every configuration: untiled on one rank, tiled on
one rank (1 and all threads), and the tiles spread over 2 and 4 gloo ranks of one thread
each. The VAE is Wan2.1's architecture (AutoencoderKLWan, base_dim 96, z_dim 16) with seeded
random weights (`--vae tiny` is the built-in model's closed-form VAE; `--vae hunyuan` a
narrow HunyuanVideo VAE). Time is the slowest rank's, from the latents to the writer's
blended video (tiles gathered); memory is the peak resident set increase of rank 0 (and of
the busiest other rank) over its size before the decode, read from the kernel (ru_maxrss).
On a 2-core machine 4 ranks oversubscribe the cores: that row shows overhead, not scaling.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.layout import ParallelLayout, virtual_node_map  # noqa: E402
from runtime.comm import Comm  # noqa: E402
from runtime.config import DecodeOptions  # noqa: E402
from runtime.mesh import build_mesh  # noqa: E402
from runtime.vae import decode_video  # noqa: E402
from slurm.launchers.processes import run_ranks  # noqa: E402


def build_vae(kind: str):
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLWan

    torch.manual_seed(0)
    if kind == "tiny":
        return AutoencoderKLWan.from_pretrained(ROOT / "runtime/models/tiny/weights/vae").eval()
    if kind == "hunyuan":
        return AutoencoderKLHunyuanVideo(block_out_channels=(32, 64, 64, 64), norm_num_groups=16).eval()
    return AutoencoderKLWan().eval()  # Wan2.1's VAE: diffusers' defaults are its configuration


def latents(kind: str, height: int, width: int, frames: int) -> torch.Tensor:
    vae = build_vae(kind)
    ratio = vae.spatial_compression_ratio
    z = vae.config.get("z_dim") or vae.config.latent_channels
    shape = (1, z, (frames - 1) // 4 + 1, height // ratio, width // ratio)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank, world, events, kind, z, options):
    from runtime.context import RankContext

    torch.set_num_threads(1)
    layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy="ring")
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=600)
    ctx = RankContext(mesh, Comm(mesh))
    vae = build_vae(kind)
    base = rss_bytes()
    ctx.gather(None)  # start together
    start = time.perf_counter()
    out = decode_video(vae, z, options, ctx)
    ctx.gather(None)  # the writer has blended
    return time.perf_counter() - start, max(0, peak_rss_bytes() - base), out.record, out.video_BCFHW


def one_process(kind: str, z: torch.Tensor, options: DecodeOptions, threads: int):
    torch.set_num_threads(threads)
    vae = build_vae(kind)
    base = rss_bytes()
    start = time.perf_counter()
    out = decode_video(vae, z, options)
    return time.perf_counter() - start, max(0, peak_rss_bytes() - base), out.record, out.video_BCFHW


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vae", choices=("wan2.1", "hunyuan", "tiny"), default="wan2.1")
    ap.add_argument("--height", type=int, default=320)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--tile", type=int, default=128, help="tile side in pixels (stride 3/4)")
    args = ap.parse_args()
    # The ranks' entry points by module name: spawned processes cannot unpickle __main__'s.
    this = importlib.import_module("benchmarks.vae")
    z = latents(args.vae, args.height, args.width, args.frames)
    tiled = DecodeOptions(tiling=True, tile_px=args.tile)
    rows = []
    # Untiled first: its RSS peak, set in this process, would hide later ones (ru_maxrss only
    # grows), so each one-process row runs in a fresh process of its own via run_ranks(world 1).
    for name, options, threads in (
        ("untiled, 1 rank", DecodeOptions(), 1),
        ("tiled, 1 rank", tiled, 1),
        ("tiled, 1 rank, 2 threads", tiled, 2),
    ):
        (res,) = run_ranks(this._one, 1, (args.vae, z, options, threads), timeout_s=3600)
        rows.append((name, *res))
    reference = rows[1][4]
    for world in (2, 4):
        per_rank = run_ranks(
            this._rank, world, (args.vae, z, DecodeOptions(parallel=True, tile_px=args.tile)), timeout_s=3600
        )
        wall = max(r[0] for r in per_rank)
        others = max(r[1] for r in per_rank[1:])
        err = (per_rank[0][3] - reference).abs().max().item()
        rows.append((f"tiled, {world} ranks", wall, per_rank[0][1], per_rank[0][2], per_rank[0][3], others, err))
    base = rows[1][1]
    print(
        f"{args.vae} VAE, {args.width}x{args.height}x{args.frames} (latent {list(z.shape)}), tiles of "
        f"{args.tile} px; {os.cpu_count()} CPU cores, torch {torch.__version__}\n"
    )
    print(
        "| decode | tiles | time (s) | vs tiled 1 rank | rank 0 peak RSS + (MB) | other ranks' peak + (MB) "
        "| max abs vs 1-rank tiled |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    untiled = rows[0][4]
    for row in rows:
        name, wall, peak, record, video = row[:5]
        other = f"{row[5] / 1e6:.0f}" if len(row) > 5 else "-"
        err = f"{row[6]:.1e}" if len(row) > 6 else "-"
        print(f"| {name} | {record['tiles']} | {wall:.2f} | {base / wall:.2f}x | {peak / 1e6:.0f} | {other} | {err} |")
    psnr = _psnr(reference, untiled)
    print(f"\ntiled vs untiled decode of the same latents: PSNR {psnr} dB (video in [-1, 1])")


def _one(rank, world, events, kind, z, options, threads):
    return one_process(kind, z, options, threads)


def _psnr(a: torch.Tensor, b: torch.Tensor) -> str:
    mse = ((a.double() - b.double()) ** 2).mean().item()
    return "inf (identical)" if mse == 0 else f"{10 * torch.log10(torch.tensor(4.0 / mse)).item():.1f}"


if __name__ == "__main__":
    main()
