"""How often one run config's walk returns to a file it already left, CLI to MP4.

Runs `ditango generate` in this process (the built-in model, one rank, 2 steps; the local
launcher's rank runs in-process instead of a spawned one, with a one-rank gloo group), and
records with `sys.setprofile` the calls from one project file into another that take the run
config or a value it carries (its layout, items, decode, DiTango, Hybridiff or step-cache
settings) as an argument: the config's walk through the code. Prints the
stops (file-to-file transitions), the files entered, and the returns: stops into a file the
walk had already entered and left. A layout where each concern lives in one place returns
less often. `--all-calls` counts every call between project files instead.

    .venv/bin/python benchmarks/walk.py [--all-calls] [--strategy ring] [--top 10]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, whatever else is installed
PACKAGES = ("ditango_cli", "runtime", "planner", "slurm", "basics")


def project_file(filename: str) -> str | None:
    """`filename` relative to the checkout when it is project code, else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


class Trace:
    """File-level stops of the calls that cross from one project file into another."""

    def __init__(self, config_only: bool = False) -> None:
        self.config_only = config_only  # only the calls that take the run config or its parts (its walk)
        self.stops: list[str] = []
        self.cache: dict[str, str | None] = {}

    def _file(self, frame) -> str | None:
        name = frame.f_code.co_filename
        if name not in self.cache:
            self.cache[name] = project_file(name)
        return self.cache[name]

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee = self._file(frame)
        if callee is None:
            return
        if self.config_only and not carries_config(frame):
            return
        caller = frame.f_back
        while caller is not None and self._file(caller) is None:
            caller = caller.f_back  # through library frames (a hook diffusers calls) to project code
        if caller is None or self._file(caller) == callee:
            return
        if not self.stops:
            self.stops.append(self._file(caller))
        if self.stops[-1] != callee:
            self.stops.append(callee)


def config_parts(cfg) -> set[type]:
    """The run config's type and the types of the values it carries: its fields' values that are
    this project's objects (the layout, the items, the decode, DiTango, Hybridiff and step-cache
    settings), one level into theirs (DiTango's planner settings)."""
    from dataclasses import fields, is_dataclass

    def ours(value) -> bool:
        return type(value).__module__.split(".")[0] in PACKAGES

    values = [getattr(cfg, f.name, None) for f in fields(cfg) if f.init]
    values += [v for value in list(values) if isinstance(value, (list, tuple)) for v in value]
    values += [getattr(v, f.name, None) for v in list(values) if is_dataclass(v) and ours(v) for f in fields(v)]
    return {type(cfg)} | {type(v) for v in values if ours(v)}


FOLLOWED: set[type] = set()  # filled from the first RunConfig seen


def carries_config(frame) -> bool:
    """Whether the call of `frame` takes the run config, or a value it carries, as an argument."""
    code = frame.f_code
    args = [frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
    if not FOLLOWED:
        cfg = next((a for a in args if type(a).__name__ == "RunConfig"), None)
        if cfg is None or code.co_name.startswith("__"):  # one built already, not one being built
            return False
        FOLLOWED.update(config_parts(cfg))
    return any(type(a) in FOLLOWED for a in args)


def in_process_ranks(target, world_size, args=(), **_):
    """`slurm.launchers.processes.run_ranks` for one rank, in this process (so the trace sees it)."""
    import torch.distributed as dist

    from slurm.launchers.local import rank_main

    assert world_size == 1 and target is rank_main, "the walk traces a one-rank run"
    with tempfile.TemporaryDirectory() as rdzv:
        dist.init_process_group("gloo", init_method=f"file://{rdzv}/store", rank=0, world_size=1)
        try:
            events = mock.Mock(replica=0, rank=0)
            return [target(0, 1, events, *args)]
        finally:
            dist.destroy_process_group()


def walk(strategy: str | None, out: Path, config_only: bool = False) -> Trace:
    from typer.testing import CliRunner

    from ditango_cli.app import app

    argv = ["generate", "--prompt", "a red circle", "--steps", "2", "--out", str(out), "--quiet"]
    if strategy is not None:
        argv += ["--parallel", strategy]
    FOLLOWED.clear()  # taken afresh from this run's config
    trace = Trace(config_only)
    with mock.patch("slurm.launchers.local.run_ranks", in_process_ranks):
        sys.setprofile(trace)
        try:
            result = CliRunner().invoke(app, argv)
        finally:
            sys.setprofile(None)
    if result.exit_code != 0:
        raise SystemExit(f"the traced run failed ({result.exit_code}): {result.output or result.exception}")
    if not (out / "item-0001.mp4").exists() and not list(out.glob("*.mp4")):
        raise SystemExit("the traced run wrote no MP4")
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default=None, help="--parallel for the one rank (default: none)")
    parser.add_argument("--top", type=int, default=10, help="files listed by returns")
    parser.add_argument(
        "--all-calls",
        action="store_true",
        help="every call between project files, not only those that take the run config or its parts",
    )
    args = parser.parse_args()
    os.environ.setdefault("DITANGO_NO_PROGRESS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        trace = walk(args.strategy, Path(tmp) / "out", config_only=not args.all_calls)
    seen: set[str] = set()
    returns: collections.Counter[str] = collections.Counter()
    for f in trace.stops:
        if f in seen:
            returns[f] += 1
        seen.add(f)
    print("| stops | files | returns to a file already left |")
    print("|---|---|---|")
    print(f"| {len(trace.stops)} | {len(seen)} | {sum(returns.values())} |")
    print()
    print("| file | returns |")
    print("|---|---|")
    for f, n in returns.most_common(args.top):
        print(f"| {f} | {n} |")


if __name__ == "__main__":
    main()
