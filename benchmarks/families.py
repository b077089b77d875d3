"""Parity of every model family: a tiny random model of each, saved in diffusers' layout, run by
its diffusers pipeline and by `ditango generate` on 1 process and on 2 local ranks under ring
and Ulysses. Prints a markdown table of the largest absolute latent differences (float32, CPU).

    .venv/bin/python benchmarks/families.py [--out benchmarks/results/families.md]

Target (the families' tests hold it): every figure <= 1e-4.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = 'a red fox holds a sign that says "hello"'
NEGATIVE = "blurry, static"
SEED, STEPS = 3, 2


@dataclass
class Case:
    """A family's tiny model: its pipeline, its components and the run's sizes and guidance,
    as the pipeline's keyword arguments (`call`) and as ditango's flags (`flags`)."""

    family: str
    pipeline: str
    build: object  # () -> components
    size: dict
    call: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    image: bool = False  # image-to-video: both get IMAGE (a 70x110 picture the pipeline resizes)


def cases() -> list[Case]:
    from tiny_wan import TinyWanConfig, build_tiny_wan
    from tiny_wan.hunyuan import build_tiny_hunyuan
    from tiny_wan.hunyuan15 import build_tiny_hunyuan15
    from tiny_wan.ltx2 import build_tiny_ltx2_components
    from tiny_wan.skyreels import build_tiny_skyreels

    wan = TinyWanConfig(seed=7, heads=2, head_dim=12, layers=2, ffn_dim=32, text_dim=24, text_heads=2)
    return [
        Case(
            "wan (Wan2.1 T2V)",
            "WanPipeline",
            lambda: build_tiny_wan(wan),
            {"height": 32, "width": 32, "frames": 5},
            {"guidance_scale": 4.0, "negative_prompt": NEGATIVE},
            ["--guidance", "4", "--negative-prompt", NEGATIVE],
        ),
        Case(
            "hunyuanvideo",
            "HunyuanVideoPipeline",
            build_tiny_hunyuan,
            {"height": 32, "width": 48, "frames": 5},
            {"guidance_scale": 5.0, "true_cfg_scale": 3.0, "negative_prompt": NEGATIVE},
            ["--guidance", "5", "--true-cfg-scale", "3", "--negative-prompt", NEGATIVE],
        ),
        Case(
            "hunyuanvideo-1.5 (T2V)",
            "HunyuanVideo15Pipeline",
            build_tiny_hunyuan15,
            {"height": 32, "width": 48, "frames": 5},
            {"negative_prompt": NEGATIVE},
            ["--negative-prompt", NEGATIVE],
        ),
        Case(
            "hunyuanvideo-1.5 (I2V)",
            "HunyuanVideo15ImageToVideoPipeline",
            lambda: build_tiny_hunyuan15(image=True),
            {"frames": 5},  # its size is the image's bucket (the pipeline takes no height, width)
            {"negative_prompt": NEGATIVE},
            ["--negative-prompt", NEGATIVE],
            image=True,
        ),
        Case(
            "skyreels-v2 (T2V)",
            "SkyReelsV2Pipeline",
            build_tiny_skyreels,
            {"height": 32, "width": 32, "frames": 5},
            {"guidance_scale": 4.0, "negative_prompt": NEGATIVE},
            ["--guidance", "4", "--negative-prompt", NEGATIVE],
        ),
        Case(
            "ltx-2 (T2V)",
            "LTX2Pipeline",
            lambda: build_tiny_ltx2_components(seed=3),
            {"height": 64, "width": 96, "frames": 17},
            {"negative_prompt": NEGATIVE, "frame_rate": 24.0},
            ["--negative-prompt", NEGATIVE],
        ),
        Case(
            "ltx-2 (I2V)",
            "LTX2ImageToVideoPipeline",
            lambda: build_tiny_ltx2_components(seed=3),
            {"height": 64, "width": 96, "frames": 17},
            {"negative_prompt": NEGATIVE, "frame_rate": 24.0},
            ["--negative-prompt", NEGATIVE],
            image=True,
        ),
    ]


def picture(folder: Path) -> Path:
    """IMAGE: a seeded noisy 70x110 picture."""
    import numpy as np
    from PIL import Image

    path = folder / "image.png"
    Image.fromarray(np.random.default_rng(SEED).integers(0, 256, (70, 110, 3), dtype=np.uint8)).save(path)
    return path


def pipeline_latents(case: Case, folder: Path) -> dict[str, torch.Tensor]:
    """The pipeline's final latents, as ditango's latents file names them (LTX-2: audio too)."""
    import diffusers
    from PIL import Image

    pipe = getattr(diffusers, case.pipeline).from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    names = {"height": "height", "width": "width", "frames": "num_frames"}
    size = {names[k]: v for k, v in case.size.items()}
    generator = torch.Generator("cpu").manual_seed(SEED)
    call = {**case.call, **({"image": Image.open(picture(folder.parent))} if case.image else {})}
    out = pipe(prompt=PROMPT, **size, num_inference_steps=STEPS, generator=generator, output_type="latent", **call)
    audio = getattr(out, "audio", None)
    return {"latents": out.frames} if audio is None else {"latents": out.frames, "audio_latents": audio}


def ours(case: Case, folder: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    size = [f"--{k}={v}" for k, v in case.size.items()]
    cmd = [sys.executable, "-m", "ditango_cli.app", "generate", "--model", str(folder), "--prompt", PROMPT, *size]
    cmd += ["--steps", str(STEPS), "--seed", str(SEED), "--device", "cpu", "--quiet", "--save-latents"]
    cmd += ["--image", str(picture(folder.parent))] if case.image else []
    subprocess.run([*cmd, *case.flags, "--out", str(out), *extra], check=True, cwd=ROOT)
    (file,) = out.glob("*.latents.safetensors")
    return load_file(file)


def main() -> None:
    import diffusers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="Also write the table here.")
    args = ap.parse_args()
    rows = [
        "| family | 1 process vs diffusers | ring 2 vs 1 process | ulysses 2 vs 1 process |",
        "|---|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="ditango-families-") as tmp:
        for k, case in enumerate(cases()):
            folder = Path(tmp) / f"model{k}"
            getattr(diffusers, case.pipeline)(**case.build()).save_pretrained(folder, safe_serialization=True)
            want = pipeline_latents(case, folder)
            one = ours(case, folder, Path(tmp) / f"one{k}")
            errors = {name: [(one[name] - want[name]).abs().max().item()] for name in want}
            for strategy in ("ring", "ulysses"):
                flags = ("--parallel", strategy, "--gpus", "2", "--executor", "local")
                two = ours(case, folder, Path(tmp) / f"{strategy}{k}", *flags)
                for name in want:
                    errors[name].append((two[name] - one[name]).abs().max().item())
            for name, figures in errors.items():
                label = case.family if name == "latents" else f"{case.family}: {name}"
                rows.append(f"| {label} | " + " | ".join(f"{e:.1e}" for e in figures) + " |")
                print(rows[-1], flush=True)
    table = "\n".join(rows) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(f"# Family parity (largest |latent difference|, float32, CPU, {STEPS} steps)\n\n{table}")


if __name__ == "__main__":
    main()
