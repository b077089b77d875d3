"""`ditango models` and `ditango download`: the registry's names, their Hugging Face repos and
where each is found on this host; a model fetched into the Hugging Face cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from basics.errors import ConfigError
from ditango_cli.choices import canonical_model
from ditango_cli.tables import plain_console, print_tables
from runtime.models.hub import model_root
from runtime.models.loading import human_count
from runtime.models.registry import REGISTRY


def models(
    model_root_dir: Annotated[Path | None, typer.Option("--model-root", help="Folder of named checkpoints.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
) -> int:
    """List registry names with size, heads, layers and where each resolves."""
    rows = [spec.to_json(model_root(model_root_dir)) for spec in REGISTRY.values()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table("name", "repo id", "task", "params", "heads", "layers", "defaults", "resolves to")
    for row in rows:
        d = row["defaults"]
        g = f"{d['guidance']:g}" + ("" if d["guidance_2"] is None else f"/{d['guidance_2']:g}")
        table.add_row(
            row["name"],
            row["repo_id"] or "-",
            row["task"],
            human_count(row["params"]),
            str(row["heads"]),
            str(row["layers"]),
            f"{d['width']}x{d['height']}x{d['frames']}, {d['steps']} steps, cfg {g}",
            row["resolves_to"],
        )
    print_tables(plain_console(), table)
    return 0


def download(
    model: Annotated[
        str, typer.Argument(help="Registry name (`ditango models`) or Hugging Face repo id ORG/NAME[@REV].")
    ],
    revision: Annotated[str | None, typer.Option("--revision", help="A branch, tag or commit [main].")] = None,
) -> int:
    """Fetch a model into the Hugging Face cache on this host (safetensors, configs and tokenizers,
    never pickle weights) and print its snapshot folder; compute nodes then load it offline."""
    from runtime.models import hub
    from runtime.models.registry import BUILTIN_DIR
    from runtime.models.resolve import checked_dir

    name, revision = hub.split_revision(canonical_model(model), revision)
    spec = REGISTRY.get(canonical_model(name))
    if spec is not None and spec.builtin:
        typer.echo(f"{spec.name} is built in ({BUILTIN_DIR}): nothing to download", err=True)
        return 0
    repo_id = spec.repo_id if spec is not None else name if hub.is_repo_id(name) else None
    if repo_id is None:
        raise ConfigError(
            f"ditango download {model}: not a registry name (`ditango models`) or a Hugging Face repo id (ORG/NAME)"
        )
    path = checked_dir(spec, hub.download(repo_id, revision)).path
    typer.echo(f"{repo_id}{'@' + revision if revision else ''} is in the Hugging Face cache:", err=True)
    typer.echo(str(path))  # stdout: the snapshot folder alone, for scripts
    return 0
