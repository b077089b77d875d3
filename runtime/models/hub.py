"""Where a model's files are: `--model-root`, the Hugging Face cache, or a download.

A Hub repo (a repo id ORG/NAME, or the repo a registry name stands for) is looked for, in
order: under `--model-root` (ROOT/NAME, ROOT/ORG/NAME, or ROOT/models--ORG--NAME laid out as
the cache), then in the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), then, only where
the user allows it (`--download`, `ditango download`), downloaded into that cache on the
submitting host. The cache holds a repo as

    models--ORG--NAME/refs/<ref>                 a commit hash (main: the default branch)
    models--ORG--NAME/snapshots/<commit>/<file>  symlinks into blobs/
    models--ORG--NAME/blobs/<hash>               the bytes

and a snapshot folder is an ordinary diffusers directory once its symlinks are followed.
Looking up reads the disk only (huggingface_hub.try_to_load_from_cache); ranks load the
absolute snapshot path the submitting host resolved, with the hub offline (`hub_offline`).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from basics.errors import ConfigError
from basics.user_files import read_text, user_path
from runtime.errors import ModelDirError

# ORG/NAME as the Hub spells them (huggingface_hub's validate_repo_id: no "--" or "..").
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
# What a download fetches: weights as safetensors, configs, tokenizers (json, txt, sentencepiece
# .model). Pickle weights (.bin, .pt, .pth, .ckpt) can run code when loaded: never fetched.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model"]
OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
CACHE_PREFIX = "models--"
COMMIT = re.compile(r"[0-9a-f]{40}")  # what huggingface_hub writes in refs/<ref>


def is_repo_id(text: str) -> bool:
    return REPO_ID.fullmatch(text) is not None and "--" not in text and ".." not in text


def split_revision(model: str, revision: str | None = None, flag: str = "--model") -> tuple[str, str | None]:
    """'ORG/NAME@REV' -> ('ORG/NAME', 'REV'); anything else as it is, with `revision` (--revision);
    `flag`: what gave `model`, for the one line that refuses it."""
    if revision is not None and any(c.isspace() or not c.isprintable() for c in revision):
        raise ConfigError(f"--revision {revision!r}: a revision has no spaces or control characters")
    name, at, rev = model.partition("@")
    if not (at and rev and is_repo_id(name)):
        return model, revision
    if any(c.isspace() or not c.isprintable() for c in rev):
        raise ConfigError(f"{flag} {model!r}: a revision has no spaces or control characters")
    if revision and revision != rev:
        raise ConfigError(f"--model {model} and --revision {revision} name two revisions: give one")
    return name, rev


def hub_cache() -> Path:
    """The cache huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub (~/.cache/huggingface/hub).
    Read at each call: huggingface_hub.constants reads it once, at import, and a launcher or a
    test may set HF_HOME after that."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return user_path(os.path.expandvars(cache), "the Hugging Face cache").absolute()


def offline() -> bool:
    """Whether the user turned the Hub off (huggingface_hub's reading of HF_HUB_OFFLINE)."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE_ENVS)


# What a loading rank sets in the environment: the Hub off, and with it transformers' Hub
# kernels (from 5.x on by default): they would fetch code to run from the Hub and replace the
# model's layers with it, and they refuse the meta device that sharded loads start on.
OFFLINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "USE_HUB_KERNELS": "NO"}


@contextlib.contextmanager
def hub_offline():
    """The Hub off for a block: a rank loads a local snapshot and never downloads, nor runs a
    kernel from the Hub. The environment (libraries imported inside, subprocesses) and
    huggingface_hub's own flag, which it read at import and checks before every request."""
    from huggingface_hub import constants

    before = {name: os.environ.get(name) for name in OFFLINE_ENVIRONMENT}, constants.HF_HUB_OFFLINE
    os.environ.update(OFFLINE_ENVIRONMENT)
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for name, value in before[0].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        constants.HF_HUB_OFFLINE = before[1]


def cache_folder(repo_id: str, cache: Path) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo_id, repo_type="model")


def _commit(repo: Path, revision: str | None) -> str:
    """The commit a revision names: refs/<ref> (stripped: a hand-written ref may end in a
    newline), a unique prefix of a snapshot's commit, or the revision as given. No revision and
    no refs/main (a copied snapshots/ folder): its only snapshot."""
    ref = repo / "refs" / (revision or "main")
    if os.path.lexists(ref):  # read bounded, a regular file only, as UTF-8 (basics/user_files.py)
        try:
            commit = read_text(ref, "Hugging Face cache ref", 2**12).strip()
        except FileNotFoundError:
            raise ConfigError(
                f"Hugging Face cache ref {ref} is a symbolic link to nothing; fetch the repo again"
            ) from None
        if not COMMIT.fullmatch(commit):  # else a snapshot path of its own making: snapshots/../..
            raise ConfigError(  # not a ModelDirError: a damaged cache is said, not skipped for the next place
                f"Hugging Face cache ref {ref} holds no commit hash ({commit[:50]!r}); fetch the repo again"
            )
        return commit
    snapshots = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    if revision is None:
        return snapshots[0] if len(snapshots) == 1 else "main"
    prefixed = [s for s in snapshots if s.startswith(revision)]
    return prefixed[0] if len(revision) >= 7 and len(prefixed) == 1 else revision


def cached_snapshot(repo_id: str, revision: str | None = None, cache: Path | None = None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a ref such as main, or a commit hash) in the
    cache, None if it holds none. Reads the disk only."""
    from huggingface_hub import try_to_load_from_cache

    repo = cache_folder(repo_id, cache or hub_cache())
    if not repo.is_dir():
        return None
    commit = _commit(repo, revision)
    try:
        found = try_to_load_from_cache(repo_id, "model_index.json", cache_dir=str(repo.parent), revision=commit)
    except ValueError:  # a revision that cannot be a file name
        return None
    if isinstance(found, str):
        return Path(found).parent
    folder = repo / "snapshots" / commit
    return folder if folder.is_dir() else None  # a partial snapshot: its inspection says what is missing


def repo_folder_snapshot(path: Path, revision: str | None = None) -> Path | None:
    """A cache's repo folder (.../models--ORG--NAME) as its snapshot at `revision` (refs/main by
    default); None if `path` is not one."""
    if not path.name.startswith(CACHE_PREFIX) or not (path / "snapshots").is_dir():
        return None
    repo_id = path.name.removeprefix(CACHE_PREFIX).replace("--", "/", 1)
    found = cached_snapshot(repo_id, revision, path.parent) if is_repo_id(repo_id) else None
    if found is None:
        have = ", ".join(sorted(p.name for p in (path / "snapshots").iterdir())) or "none"
        raise ModelDirError(f"{path} holds no snapshot at revision {revision or 'main'} (snapshots: {have})")
    return found


def locate(
    repo_id: str, revision: str | None, root: Path | None, names: tuple[str, ...] = ()
) -> tuple[Path, str] | None:
    """(directory, where in words) of the first place holding the repo: under `root` (`names`,
    then ORG/NAME and NAME, each a diffusers directory or a cache repo folder; a plain directory
    has no revision, so an explicit one skips it), then the Hugging Face cache. None: nowhere."""
    if root is not None:
        root, (org, name) = root.absolute(), repo_id.split("/")  # absolute: ranks may start elsewhere
        candidates = dict.fromkeys((*names, repo_id, name, CACHE_PREFIX + f"{org}--{name}"))
        for candidate in (root / c for c in candidates):
            if not candidate.is_dir():
                continue
            try:
                snapshot = repo_folder_snapshot(candidate, revision)
            except ModelDirError:  # a cache-layout copy without that revision: the cache may have it
                continue
            if snapshot is not None:
                return snapshot, str(snapshot)
            if revision is None:
                return candidate, str(candidate)
    found = cached_snapshot(repo_id, revision)
    return None if found is None else (found, f"HF cache {found}")


def fetch_command(label: str, repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"ditango download {label}{rev}  (or: hf download {repo_id}{rev})"


def missing(label: str, repo_id: str, revision: str | None, root: Path | None, root_env: str) -> ModelDirError:
    """The one line for a repo found nowhere: where it was looked for, how to fetch it."""
    what = (
        f"model {label!r}"
        + ("" if label == repo_id else f" ({repo_id})")
        + (f" at revision {revision}" if revision else "")
    )
    places = f"the Hugging Face cache ({hub_cache()})"
    places = f"--model-root {root} or {places}" if root else f"{places} and no --model-root or {root_env} is set"
    how = f"fetch it with: {fetch_command(label, repo_id, revision)}"
    how += ", on a host with internet access (HF_HUB_OFFLINE is set)" if offline() else ", or pass --download"
    return ModelDirError(f"{what} is not in {places}; {how}")


def download(repo_id: str, revision: str | None = None) -> Path:
    """Fetch a snapshot of `repo_id` into the Hugging Face cache (safetensors, configs and
    tokenizers only, never pickles) and return its folder. The submitting host only."""
    if offline():
        raise ConfigError(
            f"cannot download {repo_id}: HF_HUB_OFFLINE is set (unset it on a host with internet "
            "access, or copy the snapshot here and pass --model-root)"
        )
    import huggingface_hub

    try:
        path = Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, cache_dir=str(hub_cache()), allow_patterns=ALLOW_PATTERNS
            )
        )
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError, no network, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        at = f" at revision {revision}" if revision else ""
        raise ModelDirError(f"cannot download {repo_id}{at}: {type(exc).__name__}: {first}") from None
    if not any(path.rglob("*.safetensors")):
        raise ModelDirError(
            f"{repo_id} has no .safetensors weights: ditango downloads and loads no pickle files (.bin, .pt, "
            ".pth, .ckpt); use a repo that has safetensors (a -Diffusers one) or convert it"
        )
    return path


MODEL_ROOT_ENV = "DITANGO_MODEL_ROOT"


def model_root(cli_root: str | Path | None) -> Path | None:
    """--model-root, else $DITANGO_MODEL_ROOT, else None; one that is not a folder is an error."""
    root = cli_root or os.environ.get(MODEL_ROOT_ENV) or None
    if not root:
        return None
    where = "--model-root" if cli_root else MODEL_ROOT_ENV
    path = user_path(root, where)
    if not path.is_dir():
        raise ConfigError(f"{where} {root}: not a folder (the folder of named checkpoints)")
    return path
