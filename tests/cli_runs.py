"""`ditango generate` as a user starts it: a subprocess of this environment's command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DITANGO = Path(sys.executable).parent / "ditango"
# Two local ranks on a small video of the built-in model: a few seconds a step.
TWO_SMALL_RANKS = ("--gpus", "2", "--frames", "5", "--height", "64", "--width", "64")


def generate(out: Path, *args: str, prompt: str = "a red circle moving left") -> tuple[dict, str]:
    """Run `ditango generate --out OUT ARGS`, which must succeed: (its report.json, its stderr)."""
    cmd = [str(DITANGO), "generate", "--prompt", prompt, "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "report.json").read_text()), done.stderr
