"""Recorded DiTango plan shapes: regenerates planner/plan_shapes.json, which `ditango simulate`
prices DiTango from when it is given no `--plan`.

    .venv/bin/python benchmarks/plan_shapes.py [--out planner/plan_shapes.json] [--work DIR]

Runs the built-in model for 50 steps on 4 single-GPU virtual nodes with group size 1 (so
3 remote ring offsets, no own-group unit), with each planner at each cache ratio, and
keeps of each run's plan file only its shape (planner/plan_shape.py `plan_shape`): the
share of non-exact steps that were anchors, and per ring offset the fraction of cells
computed on selective steps. The file records the command and the date; it is data the
cost model reads, so this script is the only thing that should write it. About a minute
per run on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.plan_shape import PLAN_SHAPES_FILE, SHAPES_FORMAT, plan_shape  # noqa: E402

RATIOS = {"hpdc": (0.2, 0.4, 0.6, 0.8), "budget": (0.2, 0.4, 0.6, 0.8, 0.9)}
STEPS = 50
COMMAND = (
    'ditango generate --model tiny-wan --prompt "a red circle moving left on a black background" '
    f"--steps {STEPS} --device cpu --executor local --gpus-per-node 1 --nodes 4 --parallel ditango --reuse always "
    "--group-size 1 --planner {planner} --cache-ratio {ratio} --quiet --overwrite --out DIR"
)


def record(exe: Path, out: Path, planner: str, ratio: float) -> dict:
    """One run's shape, as the JSON stores it, checked against the report's own summary."""
    cmd = [
        str(exe),
        "generate",
        "--model",
        "tiny-wan",
        "--prompt",
        "a red circle moving left on a black background",
        "--steps",
        str(STEPS),
        "--device",
        "cpu",
        "--executor",
        "local",
        "--gpus-per-node",
        "1",
        "--nodes",
        "4",
        "--parallel",
        "ditango",
        "--group-size",
        "1",
        "--reuse",
        "always",
        "--planner",
        planner,
        "--cache-ratio",
        str(ratio),
        "--quiet",
        "--overwrite",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True)
    attention = json.loads((out / "report.json").read_text(encoding="utf-8"))["items"][0]["attention"]
    shape = plan_shape(json.loads((out / attention["plan_file"]).read_text(encoding="utf-8")), planner, ratio)
    assert abs(shape.selective_fraction - attention["computed_fraction_selective"]) < 1e-5, (shape, attention)
    return {
        "cache_ratio": ratio,
        "anchor_share": round(shape.anchor_share, 6),
        "own": shape.own,
        "offsets": [round(f, 6) for f in shape.offsets],
        "warmup": shape.warmup,
        "cooldown": shape.cooldown,
        "selective_fraction": round(shape.selective_fraction, 6),
        "steps": attention["steps"],
    }


def dumps(data: dict) -> str:
    """JSON with one line per recorded shape, so that a rerun's diff reads shape by shape."""
    shapes = ",\n".join(
        f'  "{planner}": [\n' + ",\n".join("   " + json.dumps(s) for s in runs) + "\n  ]"
        for planner, runs in data["shapes"].items()
    )
    head = json.dumps({k: v for k, v in data.items() if k != "shapes"}, indent=1)[:-2]
    return head + ',\n "shapes": {\n' + shapes + "\n }\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PLAN_SHAPES_FILE)
    ap.add_argument("--work", type=Path, default=None, help="Where the runs go (default: a temporary directory).")
    args = ap.parse_args()
    root = args.work or Path(tempfile.mkdtemp(prefix="ditango-plan-shapes-"))
    exe = Path(sys.executable).with_name("ditango")
    shapes = {
        planner: [record(exe, root / f"{planner}-{r:g}", planner, r) for r in ratios]
        for planner, ratios in RATIOS.items()
    }
    data = {
        "format": SHAPES_FORMAT,
        "written_by": "benchmarks/plan_shapes.py",
        "command": COMMAND,
        "date": datetime.date.today().isoformat(),
        "recorded_on": "tiny-wan (4 layers), 4 ranks, group size 1: 3 remote offsets, no own-group unit",
        "note": "per planner and cache ratio: anchor_share = anchors / non-exact steps; own, offsets = computed "
        "fraction on selective steps of the own-group unit (null: none, group size 1) and of the remote ring "
        "offsets 1, 2, ... nearest first; warmup, cooldown = exact steps at the start and end (generate's "
        "defaults for the planner); selective_fraction and steps are for reading, not used",
        "shapes": shapes,
    }
    args.out.write_text(dumps(data), encoding="utf-8")
    for planner, runs in shapes.items():
        for s in runs:
            print(
                f"{planner} {s['cache_ratio']:g}: anchors {s['anchor_share']:.3f} of non-exact steps, "
                f"selective {s['selective_fraction']:.3f}, per offset {s['offsets']}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
