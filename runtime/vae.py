"""The VAE decode: diffusers' tiles, spread over a replica's ranks.

The tiles are diffusers' own (`enable_tiling`): the same grid, the same per-tile decode and
the same blending of the overlaps, so one process equals the VAE's `tiled_decode` (and, for
HunyuanVideo, its frame-chunked `_temporal_tiled_decode`), and R ranks equal one process:
rank r decodes tiles r, r + R, ..., the writer (rank 0) receives the others' tiles and
blends. A tile is (frame chunk, row, column); an untiled decode has one tile per frame chunk
(Wan: one chunk, its causal caches carry the frames; HunyuanVideo: diffusers' frame chunks,
which it decodes one by one whether tiled or not).

This is a distribution of diffusers' tiles, not a spatial split with halo exchange: a tiled
video differs from the untiled one in the blended overlaps (`--reference exact` records
the PSNR between them), and the split is exact against one process's tiled decode.

Legend: B batch, C channels, F frames, H height, W width (latent or sample, as named).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from runtime.comm import Comm
from runtime.config import DecodeOptions
from runtime.models.families import family_of_vae


class Tile(NamedTuple):
    """One tile of a latent video [B, C, F, H, W]: frame chunk `chunk`, grid row and column."""

    chunk: int
    row: int
    col: int
    frames: slice
    rows: slice
    cols: slice


class TiledDecoder:
    """A VAE's tile grid, per-tile decode and blending, as its diffusers class does them."""

    def __init__(self, vae, options: DecodeOptions) -> None:
        self.vae, self.options = vae, options
        self.family = family_of_vae(vae)
        tiling = self.family.tiling(vae, options.tiled, options.tile_px)
        self.tiled, self.ratio = tiling.enabled, tiling.ratio
        self.min_px, self.stride_px = tiling.min_px, tiling.stride_px
        self.patch = tiling.patch  # pixel blocks as channels (Wan2.2's VAE)
        self.min_side = tiling.min_side

    # -- the grid ------------------------------------------------------------------------------
    def chunks(self, F: int) -> list[slice]:
        """Frame chunks of the latent, as the family's VAE decodes them."""
        return self.family.vae_chunks(self.vae, F)

    def spatially_tiled(self, H: int, W: int) -> bool:
        lmin = self.min_px // self.ratio
        return self.tiled and (W > lmin or H > lmin)

    def grid(self, z_BCFHW: torch.Tensor) -> list[Tile]:
        _, _, F, H, W = z_BCFHW.shape
        tiles = []
        for c, frames in enumerate(self.chunks(F)):
            if not self.spatially_tiled(H, W):
                tiles.append(Tile(c, 0, 0, frames, slice(0, H), slice(0, W)))
                continue
            lmin = self.min_px // self.ratio
            for r, i in enumerate(self.starts(H)):
                for k, j in enumerate(self.starts(W)):
                    tiles.append(Tile(c, r, k, frames, slice(i, min(i + lmin, H)), slice(j, min(j + lmin, W))))
        return tiles

    def starts(self, n: int) -> list[int]:
        """Where tiles begin along a side of `n` latents: every stride, as diffusers' grid; a last
        one narrower than the decoder takes is left out when the one before covers it."""
        lmin, lstride = self.min_px // self.ratio, self.stride_px // self.ratio
        found = list(range(0, n, lstride))
        if len(found) > 1 and n - found[-1] < self.min_side and found[-2] + lmin >= n:
            found.pop()
        return found

    # -- one tile --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode_tile(self, z_BCFHW: torch.Tensor, tile: Tile) -> torch.Tensor:
        """The decoder's output for one tile: before blending, unpatchify and clamp."""
        return self.family.decode_tile(self.vae, z_BCFHW[:, :, tile.frames, tile.rows, tile.cols])

    # -- blending ----------------------------------------------------------------------------------
    def assemble(self, z_BCFHW: torch.Tensor, tiles: list[Tile], decoded: list[torch.Tensor]) -> torch.Tensor:
        """The video [B, C, F, H, W] from every tile's decode (in `tiles` order)."""
        _, _, F, H, W = z_BCFHW.shape
        by_chunk: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        for tile, out in zip(tiles, decoded, strict=True):
            by_chunk.setdefault(tile.chunk, {})[(tile.row, tile.col)] = out
        chunks = [self._blend_spatial(by_chunk[c], H, W) for c in sorted(by_chunk)]
        return self.family.join_chunks(self.vae, chunks, F)

    def _blend_spatial(self, grid: dict[tuple[int, int], torch.Tensor], H: int, W: int) -> torch.Tensor:
        if len(grid) == 1 and not self.spatially_tiled(H, W):
            return grid[(0, 0)]
        vae, p = self.vae, self.patch
        stride = self.stride_px // p
        blend = self.min_px // p - stride  # diffusers' own rounding (Wan2.2 blends in patches)
        n_rows, n_cols = max(r for r, _ in grid) + 1, max(c for _, c in grid) + 1
        rows = [[grid[(r, c)] for c in range(n_cols)] for r in range(n_rows)]
        result = []
        for i, row in enumerate(rows):
            line = []
            for j, tile in enumerate(row):  # the tile above and the one to the left blend into this one
                if i > 0:
                    tile = vae.blend_v(rows[i - 1][j], tile, blend)
                if j > 0:
                    tile = vae.blend_h(row[j - 1], tile, blend)
                # The last row and column keep all they hold (a last tile left out: the edge is theirs).
                down, across = (None if i == n_rows - 1 else stride), (None if j == n_cols - 1 else stride)
                line.append(tile[:, :, :, :down, :across])
            result.append(torch.cat(line, dim=-1))
        return torch.cat(result, dim=3)[:, :, :, : H * self.ratio // p, : W * self.ratio // p]


@dataclass
class Decoded:
    """A decode's video (the writer's; None elsewhere) and its record."""

    video_BCFHW: torch.Tensor | None
    record: dict


@torch.no_grad()
def decode_video(vae, z_BCFHW: torch.Tensor, options: DecodeOptions, ctx=None) -> Decoded:
    """Decode latents (already scaled for the VAE). `ctx` (runtime/run.py RankContext) with
    `options.parallel`: every rank of the replica must call this; rank r decodes tiles
    r, r + R, ... and the writer gathers and blends them. Without it, one process decodes."""
    start = time.perf_counter()
    if not options.tiled:
        vae.disable_tiling()  # a tiled decode before (of this VAE) left diffusers' tiling on
        video = vae.decode(z_BCFHW, return_dict=False)[0]
        return Decoded(video, {"mode": "untiled", "tiles": 1, "ranks": 1, "per_rank_s": [_elapsed(start, video)]})
    decoder = TiledDecoder(vae, options)
    tiles = decoder.grid(z_BCFHW)
    ranks, rank = (1, 0) if ctx is None or not options.parallel else (ctx.mesh.world_size, ctx.mesh.rank)
    mine = {k: decoder.decode_tile(z_BCFHW, tiles[k]) for k in range(rank, len(tiles), ranks)}
    own_s = _elapsed(start, *mine.values())
    record = {"mode": "tiled", "tiles": len(tiles), "ranks": ranks, "tile_px": decoder.min_px}
    if ranks == 1:
        return Decoded(
            decoder.assemble(z_BCFHW, tiles, [mine[k] for k in range(len(tiles))]), {**record, "per_rank_s": [own_s]}
        )
    decoded, received = gather_tiles(ctx.comm, ctx.mesh, mine, tiles)
    per_rank = ctx.gather((own_s, received))
    record = {**record, "per_rank_s": [s for s, _ in per_rank], "bytes": sum(b for _, b in per_rank)}
    if decoded is None:
        return Decoded(None, record)
    return Decoded(decoder.assemble(z_BCFHW, tiles, decoded), record)


def tile_shapes(comm: Comm, mesh, mine: dict[int, torch.Tensor], tiles: list[Tile]) -> list[dict]:
    """Every rank's {tile: decoded shape}, over the control group (tiles differ at the edges)."""
    return comm.gather_objects({k: tuple(t.shape) for k, t in mine.items()}, mesh.control_group, range(mesh.world_size))


def gather_tiles(comm: Comm, mesh, mine: dict[int, torch.Tensor], tiles: list[Tile]):
    """Every rank's decoded tiles on the writer, in tile order (None elsewhere), and the bytes
    this rank received. Shapes go over the control group first, then each rank's tiles travel
    to the writer as one flat block on the replica's group."""
    count = len(tiles)
    shapes = tile_shapes(comm, mesh, mine, tiles)
    before = _received(comm)
    if mesh.rank != 0:
        if mine:
            flat = torch.cat([mine[k].reshape(-1) for k in sorted(mine)])
            comm.one_way(flat, mesh.rank, 0, None, None, None, mesh.world_group, "vae")
        return None, _received(comm) - before
    out: list[torch.Tensor | None] = [None] * count
    for k, t in mine.items():
        out[k] = t
    sample = mine[0]  # the writer decodes tile 0 itself: the tiles' dtype and device
    for src in range(1, mesh.world_size):
        theirs = shapes[src]
        if not theirs:
            continue
        sizes = [torch.Size(theirs[k]).numel() for k in sorted(theirs)]
        flat = comm.one_way(None, src, 0, (sum(sizes),), sample.dtype, sample.device, mesh.world_group, "vae")
        for k, part in zip(sorted(theirs), flat.split(sizes), strict=True):
            out[k] = part.view(theirs[k])
    assert all(t is not None for t in out), "a tile was decoded by no rank"
    return out, _received(comm) - before


def _received(comm: Comm) -> int:
    totals = comm.totals()
    return totals["intra_node_bytes"] + totals["inter_node_bytes"]


def _elapsed(start: float, *tensors: torch.Tensor) -> float:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    return time.perf_counter() - start
