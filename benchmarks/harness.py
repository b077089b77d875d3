"""What the generation benchmarks share (ditango.py, fidelity.py, quality.py): a folder of
runs, the first N evaluation prompts as a batch file, the `ditango` command beside this
Python, and one decoder of the latents each run saves, so every run's frames come from the
same decode."""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.denoiser import Denoiser  # noqa: E402
from runtime.models.loading import load_components, resolve_placement  # noqa: E402
from runtime.models.resolve import resolve_model  # noqa: E402
from tiny_wan.data import eval_prompts  # noqa: E402


@dataclass
class Bench:
    root: Path  # one folder per run below it
    specs: dict  # prompt id -> its PromptSpec (what the judge checks)
    prompt_file: Path  # the prompts as a JSONL batch file
    exe: Path  # the `ditango` command of this environment
    decoder: Denoiser  # the model, for decoding saved latents
    max_text_len: int
    default_steps: int


def bench(prompts: int, root: Path | None = None, prefix: str = "ditango-bench-", model: str = "tiny-wan") -> Bench:
    """The set-up of a benchmark of `prompts` prompts under `root` (None: a new temporary folder)."""
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    root = root or Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    specs = {f"p{i:02d}": p for i, p in enumerate(eval_prompts(prompts))}
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": k, "prompt": p.caption}) + "\n" for k, p in specs.items()))
    resolved = resolve_model(model)
    placement = resolve_placement("cpu")
    decoder = Denoiser(load_components(resolved, placement), placement, resolved.spec.defaults.max_text_len)
    d = resolved.spec.defaults
    return Bench(root, specs, prompt_file, Path(sys.executable).with_name("ditango"), decoder, d.max_text_len, d.steps)
