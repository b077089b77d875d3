"""Which items a rerun skips: an item whose MP4 and "done" sidecar exist was made by an
earlier run of the same item (its fields, its LoRA files by content) and the same method
(DiTango's, Hybridiff's and the step cache's settings: runtime/outputs.py `video_method`); outputs made with
other settings are refused, never skipped or overwritten behind the user's back."""

from __future__ import annotations

import json

from basics.errors import ConfigError
from runtime.config import Item, RunConfig
from runtime.outputs import output_paths, read_record, video_method

# What must match for an existing output to count as this item's (the layout may differ:
# exact strategies produce the same video).
RESUME_KEYS = (
    "model", "prompt", "negative_prompt", "seed", "height", "width", "frames", "steps", "guidance", "guidance_2",
    "true_cfg_scale", "image", "scheduler", "flow_shift", "fps",
)  # fmt: skip
# Keys that sidecars written before they existed lack: such a video was made with the model's
# own scheduler and frame rate, which is what an item asks for unless told otherwise.
LATER_KEYS = ("scheduler", "flow_shift", "fps")


def lora_identity(loras) -> list:
    """What of an item's adapters shapes its video: each file (by content), scale and expert,
    in order (a sidecar from before adapters, or of an item without any: none)."""
    if not isinstance(loras, list):
        return []
    return [[a.get("sha256"), a.get("scale"), a.get("expert")] for a in loras if isinstance(a, dict)]


def _lora_text(loras) -> str:
    shown = [f"{a.get('source')}:{a.get('scale')}" for a in (loras or []) if isinstance(a, dict)]
    return ", ".join(shown) or "none"


def _method_text(method: dict, key: str) -> str:
    value = method.get(key)
    return "none" if value is None else f"{key} {json.dumps(value, separators=(',', ':'))}"


def completed_record(cfg: RunConfig, item: Item) -> dict | None:
    """The sidecar of this item if its outputs are complete, else None.

    Complete: MP4 and a "done" sidecar exist (and the latents file when asked for).
    Outputs made with other settings raise instead of being skipped or overwritten.
    """
    paths = output_paths(cfg.out_dir, item.id)
    record = read_record(paths["sidecar"])
    if record is None or record.get("status") != "done" or not paths["video"].is_file():
        return None
    wanted = {"model": cfg.model, **item.to_json()}
    differ = [k for k in RESUME_KEYS if record.get(k) != wanted[k] and (k in record or k not in LATER_KEYS)]
    if lora_identity(record.get("loras")) != lora_identity(wanted["loras"]):
        differ.append("loras")
    if differ:
        k = differ[0]
        made, asked = record.get(k), wanted[k]
        if k == "loras":
            made, asked = _lora_text(made), _lora_text(asked)
        raise ConfigError(
            f"{item.source}: {paths['video']} exists but was made with {k} {made!r}, not {asked!r}; "
            "use --overwrite to replace it, or another --out"
        )
    made, asked = record.get("method") or {}, video_method(cfg)  # a sidecar without one: an exact run's
    if made != asked:
        k = min(k for k in {*made, *asked} if made.get(k) != asked.get(k))
        raise ConfigError(
            f"{item.source}: {paths['video']} exists but was made with {_method_text(made, k)}, not "
            f"{_method_text(asked, k)}; use --overwrite to replace it, or another --out"
        )
    audio = record.get("audio")  # a model with an audio track (LTX-2): muxed, or left out by --no-audio
    if isinstance(audio, dict) and bool(audio.get("muxed")) == cfg.no_audio:
        made, asked = ("with", "without (--no-audio)") if cfg.no_audio else ("without", "with")
        raise ConfigError(
            f"{item.source}: {paths['video']} exists {made} its audio track, not {asked}; "
            "use --overwrite to replace it, or another --out"
        )
    if cfg.save_latents and not paths["latents"].is_file():
        return None
    return record


def plan_resume(cfg: RunConfig) -> dict[str, dict]:
    """{item id: existing record} for the items a run will skip (none with `overwrite`)."""
    if cfg.overwrite:
        return {}
    done = {}
    for item in cfg.items:
        record = completed_record(cfg, item)
        if record is not None:
            done[item.id] = {**record, "status": "skipped"}
    return done
