"""LoRA adapters: `--lora SOURCE[:SCALE]` (and `--lora-2` for a two-expert model's second
expert), or per item in a JSONL batch (`"loras": [{"source": ..., "scale": ..., "expert": 2}]`).

A source is a local `.safetensors` file, a folder holding one, or a Hub repo id resolved like
models (the cache, never a download on a rank). Only safetensors: a pickle (`.bin`, `.pt`,
`.ckpt`, `.pth`) is refused before anything is read.

Loading is diffusers' own: the pipeline's `load_lora_weights` (its key conversions for the
family's trainer formats, and Wan's T2V-to-I2V expansion) through peft, then `set_adapters`
with the scales, exactly as a diffusers user does. Where one adapter set serves the whole run
the adapters are fused into the weights and peft's layers removed: the model is a plain one
again, which every strategy splits, shards and runs as the base model, at no cost per step.
A batch whose items use several sets keeps the adapters unfused and switches sets between
items (`use_set`), so the base model is loaded once.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import Unreadable, user_path
from planner.strategy import Strategy
from runtime.models import hub
from runtime.models.adapter_checks import check_against
from runtime.models.weight_files import PICKLE_SUFFIXES, tensor_shapes

# LoRAs an item may stack (each a set of layers applied at every step): a bound on a list a
# file gives, far above what a video uses.
MAX_PER_ITEM = 16


@dataclass(frozen=True)
class Adapter:
    """One LoRA of an item: `source` as the user gave it, its `scale`, the `expert` it adapts
    (1: the transformer, 2: a two-expert model's transformer_2), and once resolved the file
    (`path`) and its `sha256`."""

    source: str
    scale: float = 1.0
    expert: int = 1
    path: str = ""
    sha256: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def label(self) -> str:
        return f"{self.source}:{self.scale:g}" + (" (expert 2)" if self.expert == 2 else "")


def parse_lora(text: str, expert: int = 1, where: str = "--lora") -> Adapter:
    """'style.safetensors:0.7' -> Adapter; a scale is the text after the last ':' when it is a
    number (a path or repo id may itself hold ':')."""
    source, sep, tail = text.rpartition(":")
    scale = 1.0
    if sep:
        try:
            scale = float(tail)
        except ValueError:
            source = text
        else:
            if not source:
                raise ConfigError(f"{where} {text!r}: no source before the scale")
    else:
        source = text
    return checked(Adapter(source.strip(), scale, expert), where)


def from_json(entry: object, where: str) -> Adapter:
    """One entry of a JSONL item's "loras" list."""
    if isinstance(entry, str):
        return parse_lora(entry, where=where)
    if not isinstance(entry, dict) or not isinstance(entry.get("source"), str):
        raise ConfigError(
            f'{where}: each of "loras" is "SOURCE[:SCALE]" or {{"source": ..., "scale": ..., "expert": 1|2}}'
        )
    unknown = sorted(set(entry) - {"source", "scale", "expert"})
    if unknown:
        raise ConfigError(
            f'{where}: "loras" entry has unknown key(s) {", ".join(unknown)}; allowed: source, scale, expert'
        )
    scale, expert = entry.get("scale", 1.0), entry.get("expert", 1)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or (isinstance(scale, int) and abs(scale) > 100):
        raise ConfigError(f'{where}: "loras" scale must be a number within [-100, 100], got {scale!r}')
    if expert not in (1, 2) or isinstance(expert, bool):
        raise ConfigError(f'{where}: "loras" expert must be 1 or 2, got {expert!r}')
    return checked(Adapter(entry["source"].strip(), float(scale), expert), where)


def checked(adapter: Adapter, where: str) -> Adapter:
    if not adapter.source:
        raise ConfigError(f"{where}: the LoRA source is empty")
    if not math.isfinite(adapter.scale) or abs(adapter.scale) > 100:
        raise ConfigError(
            f"{where} {adapter.source}: scale must be a finite number within [-100, 100], got {adapter.scale}"
        )
    return adapter


def beside(text: str, folder: Path) -> str:
    """A `SOURCE[:SCALE]` that a file in `folder` names (a run file), as it means it: a relative
    path taken from `folder`, unless it is there no path and reads as a repo id (ORG/NAME)."""
    adapter = parse_lora(text)
    try:
        path = user_path(adapter.source, "LoRA")
    except Unreadable:
        return text  # said in one line where it is resolved
    if path.is_absolute() or (not (folder / path).exists() and hub.is_repo_id(adapter.source.partition("@")[0])):
        return text
    return f"{folder / path}:{adapter.scale!r}"


def resolve(adapter: Adapter, where: str = "--lora", base: Path | None = None) -> Adapter:
    """The adapter with its local file and that file's sha256, or a one-line ConfigError: a
    missing source, a pickle (by name or content), a folder with no or several .safetensors
    files. `base`: the folder a relative path is taken from (a prompt file's, a run file's;
    None: the current one)."""
    try:
        path, sha256 = _file_of(adapter.source, base)
    except ValueError as exc:
        raise ConfigError(f"{where} {adapter.source}: {exc}") from None
    return replace(adapter, path=path, sha256=sha256)


@functools.lru_cache(maxsize=256)
def _file_of(source: str, base: Path | None = None) -> tuple[str, str]:
    """(file, sha256) of a source; each file is hashed once (a batch names the same ones). The
    file is the name the source reaches, absolute but with its links kept (a Hugging Face cache
    snapshot's file links into blobs/, which have no extension); its bytes are checked as
    safetensors before it is hashed."""
    try:
        path = user_path(source, "LoRA")
    except Unreadable as exc:
        raise ValueError(exc.reason) from None
    if base is not None and not path.is_absolute():
        path = (base / path).absolute()  # beside the file that names it, wherever the command runs
    if not path.exists() and hub.is_repo_id(source.partition("@")[0]):
        repo, revision = hub.split_revision(source, flag="the LoRA")
        found = hub.locate(repo, revision, None, ())
        if found is None:
            at = f" --revision {revision}" if revision else ""
            raise ValueError(
                f"not a file or folder here, and not in the Hugging Face cache ({hub.hub_cache()}); "
                f"fetch it with: hf download {repo}{at}"
            )
        path = found[0]
    if not path.exists():
        raise ValueError(f"no such file or folder ({path})" if base is not None else "no such file or folder")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
        if len(files) != 1:
            pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
            what = (
                f"no .safetensors file (only {', '.join(pickles)}: pickle files are never loaded)"
                if pickles
                else "no .safetensors file"
                if not files
                else f"{len(files)} .safetensors files ({', '.join(p.name for p in files)}); name the file"
            )
            raise ValueError(f"the folder has {what}")
        path = files[0]
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"a pickle file ({path.suffix}); only .safetensors LoRAs are loaded")
    if path.suffix != ".safetensors":
        raise ValueError("not a .safetensors file")
    path = Path(os.path.abspath(path))  # not resolved: the loader is handed a .safetensors name
    tensor_shapes(path, "file")  # its bytes: a pickle under this name is refused, never read
    return str(path), file_sha256(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**22), b""):
            digest.update(block)
    return digest.hexdigest()


def lora_state_dict(pipeline_class, adapter: Adapter, with_metadata: bool = False):
    """The adapter's tensors as diffusers converts them for the family (`transformer.<module>.
    lora_A/B.weight`), read from its file only; `with_metadata`: (tensors, the peft config the
    file carries or None). Its name ends in .safetensors (`resolve`) and `use_safetensors` is
    set: diffusers then reads it with safetensors only, and fails rather than falling back to
    torch.load (as `AdapterBank` loads it too)."""
    path = Path(adapter.path)
    assert path.suffix == ".safetensors", path
    return pipeline_class.lora_state_dict(
        str(path.parent),
        weight_name=path.name,
        use_safetensors=True,
        local_files_only=True,
        return_lora_metadata=with_metadata,
    )


def adapter_sets(items) -> list[tuple[Adapter, ...]]:
    """The distinct adapter sets of `items`, in order of first use."""
    return list(dict.fromkeys(item.loras for item in items))


def check_sets(items, strategy: Strategy, shard_weights: bool) -> None:
    """Several sets stay unfused (peft's layers wrap the base ones), which a split of the
    weights does not take: TP splits the base layers themselves, FSDP2 shards them."""
    n = len(adapter_sets(items))
    split = f"--parallel {strategy}" if strategy.splits_weights else "--shard-weights" if shard_weights else None
    if n > 1 and split:
        raise ConfigError(
            f"the items use {n} adapter sets, which stay unfused and {split} cannot split; with "
            f"{split} run one set per run (a batch file per set, or the same loras on every item)"
        )


class AdapterBank:
    """The adapters of a run, loaded once into the pipeline's transformers by diffusers
    (`load_lora_weights`, peft). One set for the whole run: fused and peft's layers removed.
    Several: kept as adapters, and `use` activates an item's set (`set_adapters` with its
    scales; a set without adapters for an expert disables its LoRA layers)."""

    def __init__(self, pipe, sets: list[tuple[Adapter, ...]]) -> None:
        self.models = {1: pipe.transformer, 2: getattr(pipe, "transformer_2", None)}
        self.names: dict[tuple[str, int], str] = {}
        for adapter in dict.fromkeys(a for s in sets for a in s):
            key = (adapter.path, adapter.expert)
            if key in self.names:
                continue
            self.names[key] = name = f"lora{len(self.names)}"
            path = Path(adapter.path)
            with warnings.catch_warnings():  # peft warns of a second adapter in a model: here by design
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                pipe.load_lora_weights(
                    str(path.parent),
                    weight_name=path.name,
                    adapter_name=name,
                    load_into_transformer_2=adapter.expert == 2,
                    use_safetensors=True,
                    local_files_only=True,
                )
        self.fused = len(sets) == 1
        self.current: tuple[Adapter, ...] | None = None
        self.use(sets[0])
        if self.fused:
            for expert, model in self.models.items():
                if self._names(sets[0], expert):
                    model.fuse_lora(adapter_names=self._names(sets[0], expert))
                    model.unload_lora()  # a plain model again, the adapters in its weights

    def _names(self, adapters: tuple[Adapter, ...], expert: int) -> list[str]:
        return [self.names[(a.path, a.expert)] for a in adapters if a.expert == expert]

    def use(self, adapters: tuple[Adapter, ...]) -> None:
        """Make `adapters` (an item's set) the active ones."""
        if adapters == self.current:
            return
        if self.fused and self.current is not None:
            raise ValueError("a run with one adapter set has it fused: it cannot switch sets")
        for expert, model in self.models.items():
            if model is None or not getattr(model, "peft_config", None):
                continue
            names = self._names(adapters, expert)
            if names:
                model.enable_lora()
                model.set_adapters(names, [a.scale for a in adapters if a.expert == expert])
            else:
                model.disable_lora()
        self.current = adapters


def check_fit(items, spec, path: Path | None) -> None:
    """Every adapter of `items` read (as diffusers converts it) and checked against the model's
    transformers built on the meta device: a LoRA of another model is refused in one line
    before any rank starts, by `check` as by `generate`."""

    from runtime.models.families import find_class
    from runtime.models.meta import meta_transformers

    wanted = list(dict.fromkeys(a for item in items for a in item.loras))
    if not wanted:
        return
    pipeline_class = find_class(spec.variant.pipeline)
    if not hasattr(pipeline_class, "lora_state_dict"):  # diffusers has no LoRA loader for it
        raise ConfigError(f"--lora: LoRA is not supported for {spec.variant.pipeline} models (diffusers has no loader)")
    models = meta_transformers(spec, path)
    for adapter in dict.fromkeys(replace(a, scale=1.0) for a in wanted):
        where = "--lora" if adapter.expert == 1 else "--lora-2"
        try:
            state, metadata = lora_state_dict(pipeline_class, adapter, with_metadata=True)
        except Exception as exc:  # safetensors, diffusers' conversions: many types for a bad file
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ConfigError(
                f"{where} {adapter.source}: cannot read it as a LoRA ({type(exc).__name__}: {first})"
            ) from None
        model = models["transformer" if adapter.expert == 1 else "transformer_2"]
        check_against(adapter, state, model, where, metadata)


def same_weights(components: dict, ctx) -> None:
    """Every rank of the replica holds the same adapted transformers: a checksum of their
    weights (float64 sums, plain and position-weighted, per tensor) agreed over the ranks
    before the first step, so a rank that read another file never computes with the others."""
    import torch

    digest = []
    for name in ("transformer", "transformer_2"):
        for p in components[name].parameters() if name in components else ():
            flat = p.detach().reshape(-1).double()
            ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
            digest += [flat.sum().item(), (flat * ramp).sum().item()]
    mine = hashlib.sha256(repr(digest).encode()).hexdigest()
    seen = ctx.gather(mine)
    if len(set(seen)) > 1:
        odd = [r for r, h in enumerate(seen) if h != seen[0]]
        raise RuntimeError(
            f"the ranks hold different adapted weights (rank(s) {odd} differ from rank 0): "
            "each rank must read the same model and LoRA files"
        )
