"""Prompt sources -> validated Items.

`--prompt TEXT` gives one item; `--prompts FILE` gives a batch:
- `.txt`: one prompt per line; blank lines and lines starting with `#` are skipped;
- `.jsonl`: one JSON object per line with `prompt` and optionally `id`,
  `negative_prompt`, `seed`, `height`, `width`, `frames`, `steps`, `guidance`, `guidance_2`
  (a two-expert model's low-noise scale), `image` (image-to-video: a path, relative to
  the prompt file), `loras`, `scheduler`, `flow_shift` and `fps`; a line's values override the
  command line.
An image-to-video model whose pipeline sizes the video by its image (HunyuanVideo-1.5's:
`Defaults.size_of_image`) takes that size where an item gives neither height nor width.
Item ids are the given `id`, or `<index>-<hash of prompt, seed and image>`: short,
filesystem-safe, and never the raw prompt text.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import TEXT_LIMIT, check_text, parse_json, read_text, require_regular_file, user_path
from runtime.config import Item
from runtime.models import adapters, schedulers
from runtime.models.adapters import Adapter
from runtime.models.registry import Defaults
from runtime.record_shape import number as a_number

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# An item's files are <id>.mp4, <id>.json (its sidecar), <id>.latents.safetensors,
# <id>.plan.json, <id>.plan.png and <id>.rel_mae.png, beside report.json; the tool's
# bookkeeping is under .ditango/, which no id can name (ids start with a letter or digit).
# So the ids that would collide are `report` and those ending in an item file's kind (the
# sidecar of "a.plan" is item a's plan file).
RESERVED_IDS = {"report"}
RESERVED_SUFFIXES = (".plan", ".latents", ".rel_mae", ".exact", ".poster", ".steps")
INT_KEYS = ("seed", "height", "width", "frames", "steps", "fps")
JSONL_KEYS = {
    "id",
    "prompt",
    "negative_prompt",
    "guidance",
    "guidance_2",
    "true_cfg_scale",
    "image",
    "loras",
    "scheduler",
    "flow_shift",
    *INT_KEYS,
}


@dataclass(frozen=True)
class Overrides:
    """Command-line values; None means "the model's default"."""

    negative_prompt: str | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    guidance_2: float | None = None
    true_cfg_scale: float | None = None
    image: Path | None = None
    lora: list[str] | None = None  # SOURCE[:SCALE] each (runtime/models/adapters.py)
    lora_2: list[str] | None = None  # the same, for a two-expert model's second expert
    scheduler: str | None = None  # runtime/models/schedulers.py SOLVERS
    flow_shift: float | None = None
    fps: int | None = None


def derived_id(index: int, prompt: str, seed: int, image: str | None = None) -> str:
    key = f"{prompt}\0{seed}" + ("" if image is None else f"\0{image}")
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{index:04d}-{digest}"


def check_image(path: str, where: str) -> str:
    """The absolute path of a readable image, else a one-line ConfigError."""
    from PIL import Image, UnidentifiedImageError

    resolved = user_path(path, f"{where}: image", resolve=True)
    require_regular_file(resolved, f"{where}: image")
    try:
        with Image.open(resolved) as image:
            image.verify()  # the file's structure; then its pixels, as the run decodes them (a truncated file)
        with Image.open(resolved) as image:
            image.load()
    except FileNotFoundError:
        raise ConfigError(f"{where}: image {path} not found") from None
    except Image.DecompressionBombError as exc:  # not an OSError: PIL refuses to open it at all
        raise ConfigError(f"{where}: image {path} is too large to load ({exc})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{where}: image {path} cannot be read as an image ({reason})") from None
    return str(resolved)


def load_image(path: str):
    """The RGB image an item conditions on, read as diffusers' own `load_image` reads a file."""
    from diffusers.utils import load_image as diffusers_load_image

    return diffusers_load_image(path)


def image_size(path: str) -> tuple[int, int]:
    """(height, width) of the image an item conditions on, as the run reads it (`load_image`:
    turned upright by its EXIF orientation)."""
    from PIL import ExifTags, Image

    with Image.open(path) as image:
        width, height = image.size
        if image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8):  # a quarter turn
            width, height = height, width
    return height, width


def _image_of(fields: dict, cli: Overrides, defaults: Defaults, where: str) -> str | None:
    image = fields.get("image")
    image = str(cli.image) if image is None and cli.image is not None else image
    if image is None:
        if defaults.image == "required":
            raise ConfigError(
                f'{where}: this model is image-to-video: give --image PATH, or an "image" key on each JSONL line'
            )
        return None
    if defaults.image == "none":
        raise ConfigError(
            f'{where}: this model is text-to-video and takes no image (--image / "image"); '
            "use an image-to-video model (ditango models)"
        )
    return check_image(image, where)


def _check_id(value: object, where: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ConfigError(
            f"{where}: id {value!r} is not a usable file name; use 1-100 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    if value in RESERVED_IDS or value.endswith(RESERVED_SUFFIXES):
        base, _, kind = value.rpartition(".")
        clash = "report.json" if value in RESERVED_IDS else f"the {kind} file of an item {base!r}"
        raise ConfigError(
            f"{where}: id {value!r} is reserved: its files would collide with {clash} (ids may not be "
            f"'report' or end in {', '.join(RESERVED_SUFFIXES)})"
        )
    return value


def make_item(
    fields: dict, index: int, source: str, cli: Overrides, defaults: Defaults, base: Path | None = None
) -> Item:
    """The item of one prompt (`fields`: a JSONL line's, or {"prompt": ...}); `base`: the folder its
    file's relative paths are taken from (the prompt file's)."""

    def pick(key: str, cli_value, default):
        value = fields.get(key)
        if value is not None:
            return value
        return default if cli_value is None else cli_value

    prompt = fields["prompt"]
    seed = pick("seed", cli.seed, 0)
    image = _image_of(fields, cli, defaults, source)
    item_id = _check_id(fields["id"], source) if "id" in fields else derived_id(index, prompt, seed, image)
    height, width = pick("height", cli.height, None), pick("width", cli.width, None)
    if image is not None and defaults.size_of_image is not None and height is None and width is None:
        height, width = defaults.size_of_image(*image_size(image))  # the pipeline's size for this image
    guidance_2 = pick("guidance_2", cli.guidance_2, defaults.guidance_2)
    if guidance_2 is not None and defaults.experts == 1:
        raise ConfigError(f'{source}: --guidance-2 / "guidance_2" apply to two-expert models (Wan2.2 A14B) only')
    true_cfg = pick("true_cfg_scale", cli.true_cfg_scale, defaults.true_cfg)
    if true_cfg is not None and defaults.true_cfg is None:
        raise ConfigError(
            f'{source}: --true-cfg-scale / "true_cfg_scale" apply to HunyuanVideo only, whose --guidance is embedded '
            "(this model's --guidance is its CFG scale)"
        )
    item = Item(
        loras=_loras_of(fields, cli, defaults, source, base),
        id=item_id,
        prompt=prompt,
        negative_prompt=pick("negative_prompt", cli.negative_prompt, defaults.negative_prompt),
        seed=seed,
        height=defaults.height if height is None else height,
        width=defaults.width if width is None else width,
        frames=pick("frames", cli.frames, defaults.frames),
        steps=pick("steps", cli.steps, defaults.steps),
        guidance=float(pick("guidance", cli.guidance, defaults.guidance)),
        guidance_2=None if guidance_2 is None else float(guidance_2),
        true_cfg=None if true_cfg is None else float(true_cfg),
        image=image,
        scheduler=pick("scheduler", cli.scheduler, None),
        flow_shift=pick("flow_shift", cli.flow_shift, None),
        fps=pick("fps", cli.fps, defaults.fps),
        vae_stride=defaults.vae_stride,
        temporal_stride=defaults.temporal_stride,
        patch=defaults.patch,
        index=index,
        source=source,
    )
    check_geometry(item, defaults)
    return item


def _loras_of(fields: dict, cli: Overrides, defaults: Defaults, where: str, base: Path | None) -> tuple[Adapter, ...]:
    """An item's adapters: its own "loras" (a JSONL line; relative paths beside its file, at
    `base`), else --lora and --lora-2 (relative to the current folder); resolved. At most
    `adapters.MAX_PER_ITEM`, counted before any is read."""
    own = "loras" in fields
    if own and not isinstance(fields["loras"], list):
        raise ConfigError(f'{where}: "loras" must be a list of "SOURCE[:SCALE]" or objects')
    count = len(fields["loras"]) if own else len(cli.lora or ()) + len(cli.lora_2 or ())
    if count > adapters.MAX_PER_ITEM:
        given = '"loras"' if own else "--lora / --lora-2"
        raise ConfigError(f"{where}: {given} names {count} LoRAs; an item takes at most {adapters.MAX_PER_ITEM}")
    if own:
        loras = [adapters.from_json(e, where) for e in fields["loras"]]
    else:
        loras = [
            *(adapters.parse_lora(t) for t in cli.lora or ()),
            *(adapters.parse_lora(t, 2, "--lora-2") for t in cli.lora_2 or ()),
        ]
    if any(a.expert == 2 for a in loras) and defaults.experts == 1:
        raise ConfigError(f"{where}: --lora-2 (expert 2) applies to two-expert models (Wan2.2 A14B) only")
    if own:
        resolved = tuple(adapters.resolve(a, f'{where}: "loras"', base) for a in loras)
    else:
        resolved = tuple(adapters.resolve(a, "--lora" if a.expert == 1 else "--lora-2") for a in loras)
    seen: dict[tuple[str, int], Adapter] = {}
    for adapter in resolved:  # one file is one adapter of the model: a second scale would not add up
        first = seen.setdefault((adapter.sha256, adapter.expert), adapter)
        if first is not adapter:
            raise ConfigError(
                f"{where}: {first.label} and {adapter.label} are the same LoRA file; give it once, with "
                "the sum of the scales"
            )
    return resolved


def fit_to_model(items: tuple[Item, ...], spec, path: Path | None) -> tuple[Item, ...]:
    """`items` checked against the model's files before any rank starts: each LoRA against its
    transformers (on the meta device), and each item's solver and flow shift resolved against
    its scheduler, so that what makes a video is recorded whole."""
    from runtime.models.families import FAMILIES
    from runtime.models.meta import meta_scheduler

    adapters.check_fit(items, spec, path)
    base = meta_scheduler(spec, path)
    by_sigmas = FAMILIES[spec.family].SCHEDULE_BY_SIGMAS
    fitted = []
    for item in items:
        sampler = schedulers.check(item.scheduler, item.flow_shift, base, by_sigmas, item.source)
        fitted.append(replace(item, scheduler=sampler.name, flow_shift=sampler.flow_shift))
    return tuple(fitted)


def check_geometry(item: Item, defaults: Defaults) -> None:
    """Refuse the sizes that pass `Item`'s own checks (4k+1 frames, height a multiple of VAE
    stride x patch) but that the model still cannot take: they would fail inside the
    transformer with a reshape error, on every retry.

    - width: a multiple of VAE stride x the patch's width (Item checks the patch's height);
    - latent frames ((frames - 1) / time stride + 1): a multiple of the patch's time extent;
    - patches along each axis: at most the rotary table's length (`rope_max_seq_len`), which
      WanRotaryPosEmbed slices and reshapes without a check.
    """
    where = f"{item.source}: "
    stride, limit = defaults.vae_stride, defaults.rope_max_seq_len
    p_t, p_h, p_w = defaults.patch
    multiple = stride * p_w
    if item.width % multiple:
        lo = max(multiple, item.width // multiple * multiple)
        raise ConfigError(
            f"{where}width must be a positive multiple of {multiple} (VAE {stride}x times patch {p_w}x), "
            f"got {item.width}; try {lo}" + (f" or {lo + multiple}" if lo < item.width else "")
        )
    t = item.temporal_stride
    latent_frames = (item.frames - 1) // t + 1
    if latent_frames % p_t:
        lo = max(p_t, latent_frames // p_t * p_t)
        options = [t * (n - 1) + 1 for n in ((lo,) if lo > latent_frames else (lo, lo + p_t))]
        raise ConfigError(
            f"{where}frames must give a multiple of {p_t} latent frames (the transformer's time patch), "
            f"got {item.frames} ({latent_frames} latent frames); try {' or '.join(map(str, options))}"
        )
    largest = {
        "frames": t * (limit * p_t - 1) + 1,
        "height": limit * p_h * stride,
        "width": limit * p_w * stride,
    }
    for name, most in largest.items():
        value = getattr(item, name)
        if value > most:
            raise ConfigError(
                f"{where}{name} must be at most {most} for this model (its rotary positions cover {limit} "
                f"patches per axis), got {value}; try {most}"
            )


def _jsonl_fields(line: str, where: str) -> dict:
    data = parse_json(line, where)
    if not isinstance(data, dict):
        raise ConfigError(f'{where}: expected a JSON object like {{"prompt": "..."}}')
    unknown = sorted(set(data) - JSONL_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(JSONL_KEYS))}")
    if not isinstance(data.get("prompt"), str):
        raise ConfigError(f'{where}: "prompt" is required and must be a string')
    for key in ("negative_prompt", "scheduler"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f'{where}: "{key}" must be a string')
    for key in INT_KEYS:
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int)):
            raise ConfigError(f'{where}: "{key}" must be an integer, got {data[key]!r}')
    for key in ("guidance", "guidance_2", "true_cfg_scale", "flow_shift"):
        if key in data and not a_number(data[key]):
            raise ConfigError(f'{where}: "{key}" must be a number, got {data[key]!r}')
    if "image" in data and not (isinstance(data["image"], str) and data["image"].strip()):
        raise ConfigError(f'{where}: "image" must be a path (a non-empty string), got {data["image"]!r}')
    return data


_LINE_END = re.compile(r"\r\n|\r|\n")


def read_prompt_file(path: Path) -> list[tuple[dict, str]]:
    """[(fields, "FILE line N")] for every item line of a .txt or .jsonl file."""
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ConfigError(f"--prompts {path}: expected a .txt or .jsonl file")
    try:
        text = read_text(path, "--prompts", TEXT_LIMIT, encoding="utf-8-sig")  # tolerate a byte-order mark
    except FileNotFoundError:
        raise ConfigError(f"--prompts {path}: file not found") from None
    entries = []
    # Lines end at \n, \r\n or \r only: str.splitlines() also splits at U+2028, U+0085 and other
    # separators, which a JSON string may hold as they are (valid JSONL was refused).
    for number, raw in enumerate(_LINE_END.split(text), start=1):
        line = raw.strip()
        where = f"{path.name} line {number}"
        if suffix == ".txt":
            if line and not line.startswith("#"):
                entries.append(({"prompt": line}, where))
        elif line:
            fields = _jsonl_fields(line, where)
            if "image" in fields:  # relative to the prompt file, wherever the command runs
                fields["image"] = str(path.parent / user_path(fields["image"], f"{where}: image"))
            entries.append((fields, where))
    if not entries:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return entries


def build_items(prompt: str | None, prompts_file: Path | None, cli: Overrides, defaults: Defaults) -> tuple[Item, ...]:
    if prompt is not None and prompts_file is not None:
        raise ConfigError("give either --prompt or --prompts, not both")
    if prompt is None and prompts_file is None:
        raise ConfigError("nothing to generate: give --prompt TEXT or --prompts FILE")
    for text, option in ((prompt, "--prompt"), (cli.negative_prompt, "--negative-prompt")):
        check_text(text, option)  # bytes that are not UTF-8 reach argv as lone surrogates
    if prompt is not None:
        entries = [({"prompt": prompt}, "--prompt")]
    else:
        entries = read_prompt_file(prompts_file)
    base = None if prompts_file is None else prompts_file.parent
    return tuple(make_item(fields, i, where, cli, defaults, base) for i, (fields, where) in enumerate(entries))
