"""`ditango generate --dry-run`: what would be launched (slurm/placement.py `describe`), printed.

No job is submitted, no process started, no weights loaded and nothing written.
"""

from __future__ import annotations

import json
import shlex

from rich.console import Console
from rich.table import Table

from ditango_cli.tables import plain_console, print_tables
from runtime.config import RunConfig
from slurm.options import SlurmOptions
from slurm.rank import RANK_DEVICE_ENV


def show_dry_run(cfg: RunConfig, opts: SlurmOptions, where: str, as_json: bool) -> int:
    from slurm.placement import describe

    record = describe(cfg, opts, where)
    if as_json:
        print(json.dumps(record, indent=2))
        return 0
    out = plain_console(soft_wrap=True, width=max(120, Console().width))
    out.print("dry run: nothing is submitted, started, loaded or written", markup=False)
    out.print(f"executor: {record['executor_line']}", markup=False)
    out.print(
        f"device {record['device']} ({record['backend']}); {record['replicas']} replica(s) of "
        f"{cfg.layout.world_size} rank(s), strategy {cfg.layout.strategy}"
        + (f" (group size {cfg.layout.group})" if "group_size" in cfg.layout.strategy.options else "")
        + f"; {record['items']} item(s) in "
        f"{opts.array} array task(s); timeouts: step {cfg.timeout_s:g} s, setup {cfg.setup_timeout_s:g} s",
        markup=False,
    )
    out.print(
        f"attention {record['attention']}; compile {'on' if record['compile'] else 'off'}; quantize {record['quantize']}",
        markup=False,
    )
    queue = record["queue"]
    out.print(
        f"items: {queue['mode']} queue"
        + (
            f" in {cfg.out_dir}, longest first, leases of {queue['lease_s']:g} s (every replica and array task takes "
            "the next item)"
            if queue["mode"] == "shared"
            else " (round-robin over array tasks, then replicas)"
        ),
        markup=False,
    )
    if where == "sbatch":
        out.print(f"\nsbatch script (submission folder {record['folder']}):", markup=False)
        out.print(record["sbatch_script"], markup=False)
    elif where == "srun":
        out.print("\nsrun command per array task:", markup=False)
        for line in record["srun_commands"]:
            out.print(f"  {line}", markup=False)
    out.print("\nenvironment of every rank (values already set in the environment win):", markup=False)
    for key, value in record["environment"].items():  # quoted as a shell would need them
        after = '"${PYTHONPATH:+:$PYTHONPATH}"' if key == "PYTHONPATH" else ""
        out.print(f"  {key}={shlex.quote(value)}{after}", markup=False)
    out.print(f"  ({RANK_DEVICE_ENV}=cpu would make the ranks compute on CPUs whatever was requested)", markup=False)
    table = Table("rank", "node", "local", "gpu", "replica", "in replica", "cfg", "cp", "ulysses", "ring")
    with_group = "group_size" in cfg.layout.strategy.options
    if with_group:
        table.add_column("group")
    for r in record["ranks"]:
        row = [r["rank"], r["node"], r["local_rank"], "-" if r["gpu"] is None else r["gpu"], r["replica"]]
        row += [r["replica_rank"], r["cfg_index"], r["cp_index"], r["ulysses_index"], r["ring_index"]]
        if with_group:
            row.append(r["group_index"])
        table.add_row(*map(str, row))
    out.print()
    print_tables(out, table)
    return 0
