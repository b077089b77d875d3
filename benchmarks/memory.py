"""Calibrate the memory model (planner/memory.py) against measured peaks on CPU.

    python benchmarks/memory.py            # every case, a markdown table (3-5 minutes on 2 cores)
    python benchmarks/memory.py --case 3   # one case, JSON (what the table runs per case)

Method: peak RSS. Each case runs in a fresh subprocess with glibc's mmap threshold pinned at
64 KiB, so every tensor above it is its own mapping and leaves the RSS when freed. Weights:
the RSS after building the model minus the RSS before. A forward or decode: the peak RSS
(VmHWM) is reset through /proc/self/clear_refs just before it, and the peak minus the RSS
before it is the measurement. Transformers run one forward of a random-weight
`WanTransformer3DModel` (diffusers' own processor: the single-GPU path), parameters made in
the measured dtype; VAEs one decode of a random-weight `AutoencoderKLWan` /
`AutoencoderKLHunyuanVideo`, untiled or with diffusers' tiling. Inputs exist before the
measurement. The VAEs decode with oneDNN off: CPU convolutions otherwise switch between
kernels with and without an im2col buffer by shape; without oneDNN every 3x3x3 convolution
unfolds its input (27 x C_in x output voxels x 4 bytes, freed after it), which is added to
the prediction here only (cuDNN has no such buffer), and the last error column leaves it out
of the measurement too. The tiny model's forward is dominated by fixed allocations (thread
pools, buffers of a few MiB) and is not used for the mean.

Result (2 shared CPU cores, torch 2.13 CPU, diffusers 0.42.1), from which
`ACTIVATION_FACTOR` ({bf16: 1.0, fp32: 1.1}) and each family's `VAE_ACTIVATION_FACTOR` (Wan 8, HunyuanVideo 6)
are set:

| kind | case | video WxHxF | dtype | weights MiB pred / meas | peak MiB pred / meas | error | error without CPU im2col |
|---|---|---|---|---|---|---|---|
| transformer | tiny-wan | 64x64x17 | float32 | 10.5 / 18.2 | 3.4 / 10.8 | -68.9% | - |
| transformer | wan C=768 F=3072 | 320x320x33 | float32 | 92.1 / 99.7 | 141.9 / 140.7 | +0.8% | - |
| transformer | wan C=768 F=3072 | 320x320x33 | bfloat16 | 46.0 / 53.8 | 72.2 / 72.5 | -0.5% | - |
| transformer | wan C=2048 F=8192 | 256x256x25 | float32 | 389.3 / 396.9 | 185.6 / 193.8 | -4.2% | - |
| transformer | wan C=2048 F=8192 | 256x256x17 | bfloat16 | 194.6 / 202.6 | 66.5 / 68.9 | -3.5% | - |
| vae | wan2.1 vae | 96x64x9 | float32 | 484.1 / 486.6 | 371.1 / 387.0 | -4.1% | -11.1% |
| vae | wan2.1 vae | 128x128x5 | float32 | 484.1 / 486.6 | 988.7 / 952.9 | +3.8% | +11.8% |
| vae | wan2.1 vae tiled 64px | 96x96x5 | float32 | 484.1 / 486.6 | 247.7 / 259.9 | -4.7% | -12.5% |
| vae | hunyuanvideo vae | 64x64x9 | float32 | 940.2 / 942.8 | 1188.6 / 1170.8 | +1.5% | +9.0% |
| vae | hunyuanvideo vae tiled 64px | 96x64x5 | float32 | 940.2 / 942.9 | 660.6 / 664.4 | -0.6% | -3.1% |

Transformer block peaks: mean |error| 2.2%, worst -4.2%; VAE decodes: mean |error| 9.5%
(without the CPU-only im2col buffer), worst -12.5%; weights: within 8 MiB (the allocator's
fixed overhead). Not measured here: CUDA kernels' workspaces, ring attention states and the
DiTango cache (the cache is exact: tests/test_memory.py compares it with the runtime's).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# kind, name, config (a transformer config, or a registry name: its transformer's or VAE's),
# (height, width, frames), dtype, tiling (VAE: tile px or 0)
WAN_SMALL = {"num_layers": 2, "num_attention_heads": 12, "attention_head_dim": 64, "ffn_dim": 3072, "in_channels": 16,
             "out_channels": 16, "text_dim": 256, "patch_size": [1, 2, 2], "rope_max_seq_len": 256,
             "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True}  # fmt: skip
WAN_WIDE = {**WAN_SMALL, "num_layers": 1, "num_attention_heads": 16, "attention_head_dim": 128, "ffn_dim": 8192}
CASES = [
    ("transformer", "tiny-wan", "tiny-wan", (64, 64, 17), "float32", 0),
    ("transformer", "wan C=768 F=3072", WAN_SMALL, (320, 320, 33), "float32", 0),
    ("transformer", "wan C=768 F=3072", WAN_SMALL, (320, 320, 33), "bfloat16", 0),
    ("transformer", "wan C=2048 F=8192", WAN_WIDE, (256, 256, 25), "float32", 0),
    ("transformer", "wan C=2048 F=8192", WAN_WIDE, (256, 256, 17), "bfloat16", 0),
    ("vae", "wan2.1 vae", "wan2.1-14b", (64, 96, 9), "float32", 0),
    ("vae", "wan2.1 vae", "wan2.1-14b", (128, 128, 5), "float32", 0),
    ("vae", "wan2.1 vae tiled 64px", "wan2.1-14b", (96, 96, 5), "float32", 64),
    ("vae", "hunyuanvideo vae", "hunyuanvideo", (64, 64, 9), "float32", 0),
    ("vae", "hunyuanvideo vae tiled 64px", "hunyuanvideo", (64, 96, 5), "float32", 64),
]


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _measure(fn) -> int:
    before = _status("VmRSS")
    _reset_peak()
    fn()
    return _status("VmHWM") - before


def cpu_im2col_bytes(vae, latent: tuple[int, int, int], tile: int) -> int:
    """The largest im2col buffer of a decode on CPU (added to the prediction here only)."""
    from planner.decode_memory import chunks, level_frames, tile_grid

    f, h, w = latent
    th, tw = max(tile_grid(vae, h, w, tile)) if tile else (h, w)
    calls = chunks(vae, f)
    return max(
        27 * 4 * c * fr * th * tw * 4**i
        for n in set(calls)
        for i, (c, fr) in enumerate(zip(vae.widths, level_frames(vae, n), strict=True))
    )


def run_case(index: int) -> dict:
    """In this (fresh) process: build, measure, predict."""
    import torch

    from planner.decode_memory import decode_bytes
    from planner.layout import ParallelLayout
    from planner.memory import MemoryOptions, block_bytes
    from planner.models import VideoSize
    from runtime.models import wan
    from runtime.models.families import FAMILIES
    from runtime.models.registry import REGISTRY

    kind, name, config, (H, W, F), dtype, tile = CASES[index]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    dt = getattr(torch, dtype)
    e = torch.empty((), dtype=dt).element_size()
    if kind == "transformer":
        from diffusers import WanTransformer3DModel

        named = isinstance(config, str)
        cfg = REGISTRY[config].named.transformer if named else config
        known = set(WanTransformer3DModel.extract_init_dict(cfg)[0])
        stride = REGISTRY[config].defaults.vae_stride if named else 8
        shape = wan.shape_of(name, cfg, 0, 32, (4, stride, stride))
        f, h, w = shape.latent_shape(VideoSize(H, W, F))
        x = torch.randn(1, cfg["in_channels"], f, h, w, dtype=dt)
        text = torch.randn(1, shape.text_len, shape.text_dim, dtype=dt)
        t = torch.tensor([500.0])
        before = _status("VmRSS")
        torch.set_default_dtype(dt)  # parameters made in the measured dtype, not cast
        model = WanTransformer3DModel(**{k: v for k, v in cfg.items() if k in known}).eval()
        torch.set_default_dtype(torch.float32)
        weights = _status("VmRSS") - before
        params = sum(p.numel() for p in model.parameters())
        with torch.inference_mode():
            peak = _measure(lambda: model(x, t, text, return_dict=False))
        tokens = shape.tokens(VideoSize(H, W, F))
        _, _, predicted = block_bytes(shape, ParallelLayout(), tokens, MemoryOptions(dtype_bytes=e))
        return {
            "weights": weights,
            "weights_predicted": params * e,
            "peak": peak,
            "predicted": predicted,
            "tokens": tokens,
        }
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLWan

    cls = AutoencoderKLHunyuanVideo if config == "hunyuanvideo" else AutoencoderKLWan
    cfg = REGISTRY[config].named.vae
    before = _status("VmRSS")
    vae = cls(**cfg).eval()
    weights = _status("VmRSS") - before
    params = sum(p.numel() for p in vae.parameters())
    adapter = FAMILIES[REGISTRY[config].family]
    shape = adapter.vae_shape_of(cfg, params)
    latent = ((F - 1) // shape.temporal + 1, H // shape.spatial, W // shape.spatial)
    z = torch.randn(1, shape.z_dim, *latent)
    if tile:
        vae.enable_tiling(
            tile_sample_min_height=tile,
            tile_sample_min_width=tile,
            tile_sample_stride_height=tile * 3 // 4,
            tile_sample_stride_width=tile * 3 // 4,
        )
    # One convolution path on CPU: without oneDNN every 3x3x3 convolution unfolds its input
    # (im2col: 27 x C_in x output voxels x 4 bytes, freed after it), which cuDNN does not.
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=False):
        peak = _measure(lambda: vae.decode(z, return_dict=False)[0])
    im2col = cpu_im2col_bytes(shape, latent, tile)
    predicted = decode_bytes(shape, latent, bool(tile), tile or 256) + im2col
    return {
        "weights": weights,
        "weights_predicted": params * 4,
        "peak": peak,
        "predicted": predicted,
        "cpu_only": im2col,
        "latent": list(latent),
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(json.dumps(run_case(int(sys.argv[2]))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    rows = []
    for i, (kind, name, _, (H, W, F), dtype, _) in enumerate(CASES):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, __file__, "--case", str(i)], env=env, capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((kind, name, f"{W}x{H}x{F}", dtype, r, time.perf_counter() - start))
    print(
        "| kind | case | video WxHxF | dtype | weights MiB pred / meas | peak MiB pred / meas | error "
        "| error without CPU im2col | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"transformer": [], "vae": []}
    mib = 2**20
    for kind, name, video, dtype, r, secs in rows:
        err = (r["predicted"] - r["peak"]) / r["peak"]
        own = r.get("cpu_only", 0)
        err_own = (r["predicted"] - r["peak"]) / (r["peak"] - own)
        if "tiny" not in name:  # the tiny cases are dominated by fixed allocations (thread pools, buffers)
            errors[kind].append(err_own)
        print(
            f"| {kind} | {name} | {video} | {dtype} | {r['weights_predicted'] / mib:.1f} / {r['weights'] / mib:.1f} "
            f"| {r['predicted'] / mib:.1f} / {r['peak'] / mib:.1f} | {err:+.1%} | "
            f"{f'{err_own:+.1%}' if own else '-'} | {secs:.0f} |"
        )
    for kind, errs in errors.items():
        print(
            f"{kind}: mean |error| {sum(map(abs, errs)) / len(errs):.1%} over the scaled cases, "
            f"worst {max(errs, key=abs):+.1%}"
        )


if __name__ == "__main__":
    main()
