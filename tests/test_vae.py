"""The VAE decode: diffusers' tiles in one process, and spread over 2 and 3 gloo ranks.

Every VAE family we run: Wan2.1's AutoencoderKLWan (SkyReels-V2's too), Wan2.2's (residual,
2x2 patches, 16x), HunyuanVideo's (frame chunks blended in time as well), HunyuanVideo-1.5's
(16x, the whole clip in each tile). One process is held to the VAE's own `decode` with tiling
enabled (diffusers' tiled_decode); R ranks to one process. Tile counts are chosen so the split
is uneven (5 tiles; 10 for HunyuanVideo's two frame chunks; 3 for HunyuanVideo-1.5's).
"""

from __future__ import annotations

import json

import pytest
import torch

from planner.layout import ParallelLayout, virtual_node_map
from runtime.comm import Comm
from runtime.mesh import build_mesh
from runtime.vae import DecodeOptions, TiledDecoder, decode_video
from slurm.launchers.processes import run_ranks

TOL = 1e-5
TIMEOUT_S = 60


def build_vae(family: str):
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15, AutoencoderKLWan

    torch.manual_seed(7)
    if family == "hunyuan15":
        vae = AutoencoderKLHunyuanVideo15(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8, 8),
            layers_per_block=1,
            spatial_compression_ratio=16,
            temporal_compression_ratio=4,
        )
    elif family == "wan2.1":
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    elif family == "wan2.2":
        vae = AutoencoderKLWan(
            base_dim=8,
            decoder_base_dim=16,
            z_dim=4,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_temporal=4,
            scale_factor_spatial=16,
        )
    else:
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            mid_block_add_attention=True,
        )
    return vae.eval()


# (family, latent [B, C, F, H, W], tile px): one row of 5 tiles; HunyuanVideo: 2 frame chunks of 5;
# HunyuanVideo-1.5: one row of 3 (4 latents a side, stride 3), one latent frame (its decoder is slow).
CASES = [
    ("wan2.1", (1, 4, 3, 3, 13), 32),
    ("wan2.2", (1, 4, 2, 3, 13), 64),
    ("hunyuan", (1, 4, 6, 3, 13), 32),
    ("hunyuan15", (1, 4, 1, 3, 9), 64),
]
TILES = {"hunyuan": 10, "hunyuan15": 3}  # others: 5


def diffusers_tiling(vae, tile: int) -> None:
    """Tiling on as diffusers' own tiled_decode runs it: `tile` pixels a side, a quarter overlapping."""
    from diffusers import AutoencoderKLHunyuanVideo15

    if isinstance(vae, AutoencoderKLHunyuanVideo15):  # sides in latents too, and an overlap factor
        latent = tile // vae.spatial_compression_ratio
        vae.enable_tiling(
            tile_sample_min_height=tile,
            tile_sample_min_width=tile,
            tile_latent_min_height=latent,
            tile_latent_min_width=latent,
            tile_overlap_factor=0.25,
        )
        return
    stride = int(tile * 0.75)
    vae.enable_tiling(
        tile_sample_min_height=tile,
        tile_sample_min_width=tile,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
    )


def latents(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family,shape,tile", CASES, ids=[c[0] for c in CASES])
def test_one_process_equals_diffusers_tiled_decode(family, shape, tile):
    vae = build_vae(family)
    z = latents(shape)
    options = DecodeOptions(tiling=True, tile_px=tile)
    ours = decode_video(vae, z, options)
    assert ours.record["tiles"] == TILES.get(family, 5)
    diffusers_tiling(vae, tile)
    with torch.no_grad():
        ref = vae.decode(z, return_dict=False)[0]
    assert ours.video_BCFHW.shape == ref.shape
    err = (ours.video_BCFHW - ref).abs().max().item()
    assert err <= TOL, err
    # Tiled differs from untiled in the blended overlaps (what --reference exact measures)...
    vae.disable_tiling()
    with torch.no_grad():
        untiled = vae.decode(z, return_dict=False)[0]
    assert (untiled - ref).abs().max().item() > 10 * TOL
    # ...and an untiled decode is the VAE's own, even after a tiled one left tiling on.
    decode_video(vae, z, options)
    plain = decode_video(vae, z, DecodeOptions())
    assert plain.record["mode"] == "untiled" and torch.equal(plain.video_BCFHW, untiled)


def test_a_video_within_one_tile_decodes_as_untiled():
    vae = build_vae("wan2.1")
    z = latents((1, 4, 2, 3, 4))  # 24 x 32 px: inside one 32 px tile
    tiled = decode_video(vae, z, DecodeOptions(tiling=True, tile_px=32))
    untiled = decode_video(vae, z, DecodeOptions())
    assert tiled.record["tiles"] == 1
    assert (tiled.video_BCFHW - untiled.video_BCFHW).abs().max().item() <= TOL


def test_tile_grid_follows_the_tile_size():
    vae = build_vae("wan2.1")
    grid = TiledDecoder(vae, DecodeOptions(tiling=True, tile_px=32)).grid(latents((1, 4, 1, 7, 13)))
    assert [(t.row, t.col) for t in grid][:6] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]
    assert len(grid) == 3 * 5  # rows 0, 3, 6 and columns 0, 3, ..., 12 (latent stride 3)
    assert grid[-1].cols == slice(12, 13)  # clipped to the latent's 13 columns


def test_a_reflect_padded_decoder_gets_no_tile_one_latent_wide():
    """LTX-2's decoder pads with reflection, which fails on a side of 1: diffusers' grid would put
    a last tile one latent wide where a side is one more than a multiple of the stride (7 latents,
    128 px tiles: 4 latents, stride 3: tiles at 0, 3, 6). That tile is left out, the one before
    covers the edge, and the edge's pixels are that tile's own."""
    from tiny_wan.ltx2 import build_tiny_ltx2_components

    vae = build_tiny_ltx2_components(seed=1)["vae"]
    z = torch.randn((1, vae.config.latent_channels, 2, 2, 7), generator=torch.Generator().manual_seed(3))
    decoder = TiledDecoder(vae, DecodeOptions(tiling=True, tile_px=128))
    assert [t.cols for t in decoder.grid(z)] == [slice(0, 4), slice(3, 7)]
    out = decode_video(vae, z, DecodeOptions(tiling=True, tile_px=128))
    assert out.record["tiles"] == 2 and out.video_BCFHW.shape[-1] == 7 * 32
    with torch.no_grad():
        last = vae.decoder(z[..., 3:7], None)
    blend = 128 - 96  # pixels the two tiles blend over; right of them the last tile alone
    assert torch.equal(out.video_BCFHW[..., 3 * 32 + blend :], last[..., blend:])
    wan = TiledDecoder(build_vae("wan2.1"), DecodeOptions(tiling=True, tile_px=32))
    assert wan.starts(13) == [0, 3, 6, 9, 12]  # a decoder that takes a thin tile keeps diffusers' grid


# (--vae-tile px, the VAE's pixels a latent, (side, stride) px)
ALIGNED = [(256, 8, (256, 192)), (32, 8, (32, 24)), (16, 8, (16, 8)), (40, 8, (40, 24)), (64, 16, (64, 48)),
           (64, 32, (64, 32)), (100, 32, (96, 64)), (8, 32, (64, 32)), (512, 32, (512, 384))]  # fmt: skip


@pytest.mark.parametrize("px,ratio,want", ALIGNED)
def test_tiles_and_strides_are_whole_latents(px, ratio, want):
    """diffusers' grid steps by whole latents while it crops and blends in pixels: --vae-tile's
    side and its three-quarter stride are taken down to whole latents (two a side, one a stride
    at least), or the tiles would overlap at the wrong place (16 px on an 8x VAE: 12 px crops of
    tiles 8 px apart)."""
    from runtime.models.vae_tiling import aligned

    assert aligned(px, ratio) == want


def _decode_on_ranks(rank, world, events):
    from runtime.context import RankContext

    layout = ParallelLayout(nodes=1, gpus_per_node=world, strategy="ring")
    mesh = build_mesh(layout, rank, virtual_node_map(layout), timeout_s=TIMEOUT_S)
    ctx = RankContext(mesh, Comm(mesh))
    outs = []
    for family, shape, tile in CASES:  # one process group for every family: spawning is the slow part
        out = decode_video(build_vae(family), latents(shape), DecodeOptions(parallel=True, tile_px=tile), ctx)
        outs.append((out.video_BCFHW, out.record))
    return outs


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.sweep)])
def test_tiles_over_ranks_equal_one_process(world):
    per_rank = run_ranks(_decode_on_ranks, world, timeout_s=TIMEOUT_S)
    for case, (family, shape, tile) in enumerate(CASES):
        one = decode_video(build_vae(family), latents(shape), DecodeOptions(tiling=True, tile_px=tile))
        video, record = per_rank[0][case]
        assert all(r[case][0] is None for r in per_rank[1:])  # only the writer holds the video
        err = (video - one.video_BCFHW).abs().max().item()
        assert err <= TOL, (family, err)
        assert record["ranks"] == world and len(record["per_rank_s"]) == world
        # Every tile but the writer's travels to it once: the bytes are the other ranks' tiles.
        decoder = TiledDecoder(build_vae(family), DecodeOptions(tiling=True, tile_px=tile))
        tiles = decoder.grid(latents(shape))
        sent = sum(decoder.decode_tile(latents(shape), t).nbytes for k, t in enumerate(tiles) if k % world)
        assert record["bytes"] == sent, family


@pytest.mark.distributed
@pytest.mark.e2e
def test_cli_decodes_tiles_on_two_ranks_and_records_the_cost(runner, tmp_path, saved_model_dir):
    """generate on 2 ranks decodes in parallel by default; --reference exact records what the
    tiles cost against the untiled decode (a random VAE: the overlaps differ)."""
    import json

    from ditango_cli.app import app

    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(saved_model_dir),
        "--prompt",
        "a red ball",
        "--steps",
        "2",
        "--height",
        "64",
        "--width",
        "64",
        "--frames",
        "5",
        "--device",
        "cpu",
        "--quiet",
        "--gpus",
        "2",
        "--parallel",
        "ring",
        "--vae-tile",
        "32",
        "--reference",
        "exact",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    decode = json.loads((out / "report.json").read_text())["items"][0]["decode"]
    assert (decode["mode"], decode["tiles"], decode["ranks"], len(decode["per_rank_s"])) == ("tiled", 9, 2, 2)
    assert decode["bytes"] > 0 and 10 < decode["psnr_vs_untiled"] < 80, decode
    plain = [a for a in args[:-1] if a not in ("--reference", "exact", "--vae-tile", "32")]  # an untiled decode
    refused = runner.invoke(app, [*args[:-1], str(tmp_path / "one"), "--no-vae-parallel"])
    assert refused.exit_code == 2 and "--reference only applies" in refused.stderr  # nothing approximated
    one = runner.invoke(app, [*plain, str(tmp_path / "one"), "--no-vae-parallel"])
    assert one.exit_code == 0, one.stderr
    assert json.loads((tmp_path / "one" / "report.json").read_text())["items"][0]["decode"]["mode"] == "untiled"


@pytest.mark.distributed
def test_the_exact_reference_is_decoded_tiled_as_the_run(runner, tmp_path, saved_model_dir):
    """Bug: --reference exact decoded the run's latents tiled (a parallel decode is tiled) and the
    exact ones untiled, so an exact run (cache ratio 0: the same latents) measured 34 dB of tile
    seams as the approximation's error."""
    from ditango_cli.app import app

    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(saved_model_dir),
        "--prompt",
        "a red circle",
        "--out",
        str(out),
        "--steps",
        "2",
        "--height",
        "128",
        "--width",
        "128",
        "--frames",
        "5",
        "--device",
        "cpu",
        "--quiet",
        "--gpus",
        "2",
        "--parallel",
        "ditango",
        "--cache-ratio",
        "0",
        "--reference",
        "exact",
        "--vae-tile",
        "32",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    (item,) = json.loads((out / "report.json").read_text())["items"]
    assert item["decode"]["mode"] == "tiled" and item["decode"]["ranks"] == 2
    assert item["decode"]["psnr_vs_untiled"] is not None  # tiling changes this model's frames ...
    assert item["quality"]["latent_rel_err"] == 0.0 and item["quality"]["psnr"] is None  # ... but not the measure
