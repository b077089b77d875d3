"""Host memory of one rank loading a model: peak RSS before and after runtime/models/loading.py
read each component straight into its dtype onto its device.

    python benchmarks/host_memory.py                 # build the models (once, in /tmp), a markdown table
    python benchmarks/host_memory.py --one CASE DTYPE LOADER   # one measurement, JSON (what the table runs)

Method: each measurement runs in a fresh subprocess, glibc's mmap threshold pinned at 64 KiB. After torch, diffusers and transformers
are imported, the RSS is read (VmRSS); then the model is loaded onto `--device`, and the peak
(VmHWM) and the RSS after the load are read. The columns are those minus the RSS before: the
load's own host peak, and what stays on the host. VmHWM counts the safetensors files' mapped
pages too (RssFile): on a node they are one page cache shared by its ranks, but each rank's RSS
shows them.

"before" is the loader as it was (a copy below, `load_before`): the diffusers pipeline class's
from_pretrained on the CPU, then each component moved with `.to(device)`. "after" is
`runtime.models.loading.load_components`. Models: the built-in tiny-wan
(runtime/models/tiny/weights, float32 files) and a Wan-architecture directory built here
(`WanTransformer3DModel`, C=1536, F=6144, 8 layers: 302M parameters; the tiny text encoder,
VAE, tokenizer and scheduler copied beside it), saved in float32 and in bfloat16.

On the CPU both loaders leave the whole model on the host (that is the device); the difference
that matters is on a GPU (`--device cuda`), where "before" holds every component on the host
before moving it and "after" only the file being read. `--device meta` stands in for a GPU
here (a device that is not the host; the CUDA copy's own page touches are missing, so a file
read without a cast shows none of its pages).

Result (2 shared CPU cores, torch 2.13 CPU, diffusers 0.42.1, transformers 5.24), MiB:

| device | model | load dtype | files | peak before | peak after | kept before | kept after |
|---|---|---|---|---|---|---|---|
| meta | tiny-wan | float32 | 13 | 71 | 66 | 66 | 66 |
| meta | tiny-wan | bfloat16 | 13 | 83 | 72 | 66 | 66 |
| meta | wan-302m-f32 | float32 | 1229 | 75 | 69 | 66 | 66 |
| meta | wan-302m-f32 | bfloat16 | 1229 | 1895 | 1306 | 67 | 67 |
| meta | wan-302m-bf16 | bfloat16 | 616 | 88 | 80 | 67 | 66 |
| cpu | tiny-wan | float32 | 13 | 71 | 70 | 71 | 70 |
| cpu | tiny-wan | bfloat16 | 13 | 83 | 83 | 83 | 83 |
| cpu | wan-302m-f32 | float32 | 1229 | 75 | 75 | 75 | 75 |
| cpu | wan-302m-f32 | bfloat16 | 1229 | 1894 | 1894 | 1894 | 1894 |
| cpu | wan-302m-bf16 | bfloat16 | 616 | 88 | 88 | 88 | 88 |

A float32 file read into bfloat16 for a device: the host copy in bfloat16 (616 MiB) is gone;
what is left is the file's mapped pages. Where the file's dtype is the run's, the parameters
alias the mapping and no page is read until used (75-88 MiB), before and after. On the CPU
the model stays on the host either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BIG = Path("/tmp/ditango-host-memory")
BIG_CONFIG = {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 6144, "num_layers": 8}
CASES = ("tiny-wan", "wan-302m-f32", "wan-302m-bf16")  # the file dtype is in the name
ROWS = (("tiny-wan", "float32"), ("tiny-wan", "bfloat16"), ("wan-302m-f32", "float32"),
        ("wan-302m-f32", "bfloat16"), ("wan-302m-bf16", "bfloat16"))  # fmt: skip
MIB = 2**20


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def load_before(model, placement, on_cpu=()):
    """The loader before this change (runtime/models/loading.py at 1507660): the pipeline
    on the CPU in the requested dtypes, then each component moved to its device."""
    import torch

    from runtime.models.families import find_class
    from runtime.models.loading import _dtype_kwarg

    pipeline_class = find_class(model.spec.variant.pipeline)
    dtypes = {"default": placement.dtype, "vae": torch.float32, "image_encoder": torch.float32}
    pipe = pipeline_class.from_pretrained(
        str(model.path), local_files_only=True, use_safetensors=True, **{_dtype_kwarg(pipeline_class): dtypes}
    )
    components = {k: v for k, v in pipe.components.items() if v is not None}
    for name in ("text_encoder", "transformer", "transformer_2", "vae", "image_encoder"):
        if name in components:
            device = torch.device("cpu") if name in on_cpu else placement.device
            components[name].to(device).eval().requires_grad_(False)
    return components


def build(dest: Path, dtype_name: str) -> None:
    """A Wan directory: a bigger transformer, the rest of the built-in model copied."""
    import torch
    from diffusers import WanTransformer3DModel

    from runtime.models.registry import BUILTIN_DIR

    if (dest / "model_index.json").is_file():
        return
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(BUILTIN_DIR, dest, ignore=shutil.ignore_patterns("transformer", "README.md"))
    config = json.loads((BUILTIN_DIR / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")} | BIG_CONFIG
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config).to(getattr(torch, dtype_name))
    model.save_pretrained(dest / "transformer", safe_serialization=True)


def model_path(case: str) -> Path:
    from runtime.models.registry import BUILTIN_DIR

    return BUILTIN_DIR if case == "tiny-wan" else BIG / case


def measure(case: str, dtype: str, loader: str, device: str) -> dict:
    """One load in this process (a fresh one: the table's subprocess)."""
    import diffusers  # noqa: F401  (imported before the baseline RSS: not the load's)
    import torch
    import transformers  # noqa: F401

    from runtime.models.loading import load_components, placement_on, quiet_loading_bars
    from runtime.models.resolve import resolve_model

    quiet_loading_bars()
    resolved = resolve_model(str(model_path(case)))
    placement = placement_on(torch.device(device), dtype)
    base = status_kib("VmRSS")
    parts = (load_before if loader == "before" else load_components)(resolved, placement)
    peak, after = status_kib("VmHWM"), status_kib("VmRSS")
    dtypes = {
        n: sorted({str(p.dtype).removeprefix("torch.") for p in parts[n].parameters()})
        for n in ("transformer", "text_encoder", "vae")
    }
    return {
        "case": case,
        "dtype": dtype,
        "loader": loader,
        "device": device,
        "peak_mib": (peak - base) / 1024,
        "kept_mib": (after - base) / 1024,
        "dtypes": dtypes,
    }


def file_bytes(case: str) -> int:
    return sum(p.stat().st_size for p in model_path(case).rglob("*.safetensors"))


def table(device: str) -> str:
    for case in CASES[1:]:
        build(BIG / case, "float32" if case.endswith("f32") else "bfloat16")
    lines = [
        "| model | load dtype | safetensors MiB | peak RSS MiB before | after | kept on host MiB before | after |",
        "|---|---|---|---|---|---|---|",
    ]
    # Every tensor above 64 KiB its own mapping, so that a freed one leaves the RSS (glibc's
    # dynamic threshold would otherwise keep freed temporaries in the heap), as benchmarks/memory.py.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for case, dtype in ROWS:
        got = {}
        for loader in ("before", "after"):
            run = [sys.executable, __file__, "--one", case, dtype, loader, "--device", device]
            done = subprocess.run(run, check=True, capture_output=True, text=True, env=env)
            got[loader] = json.loads(done.stdout)
        assert got["before"]["dtypes"] == got["after"]["dtypes"], got
        b, a = got["before"], got["after"]
        lines.append(
            f"| {case} | {dtype} | {file_bytes(case) / MIB:.0f} | {b['peak_mib']:.0f} | {a['peak_mib']:.0f} "
            f"| {b['kept_mib']:.0f} | {a['kept_mib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=3, metavar=("CASE", "DTYPE", "LOADER"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.device)))
    else:
        print(f"device {args.device}")
        print(table(args.device))


if __name__ == "__main__":
    main()
