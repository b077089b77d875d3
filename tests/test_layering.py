"""The shape of the house: imports go down the layers ditango_cli -> slurm -> runtime -> planner -> basics,
never back up, and no module imports itself through others (function-level imports count)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ditango_cli", "slurm", "runtime", "planner", "basics")  # top to bottom


def module_imports() -> dict[str, set[str]]:
    """{module: project modules it imports anywhere in its body}."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            deps = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                deps |= {t for t in targets if t.split(".")[0] in PACKAGES}
            graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_imports_only_go_down_the_layers():
    rank = {p: i for i, p in enumerate(PACKAGES)}
    upward = [
        f"{m} -> {d}"
        for m, deps in module_imports().items()
        for d in deps
        if rank[d.split(".")[0]] < rank[m.split(".")[0]]
    ]
    assert upward == [], upward
    planner = [d for m, deps in module_imports().items() if m.startswith("planner") for d in deps]
    assert all(d.startswith(("planner", "basics")) for d in planner), planner
    basics = [d for m, deps in module_imports().items() if m.startswith("basics") for d in deps]
    assert all(d.startswith("basics") for d in basics), basics


def test_no_import_cycles():
    graph = module_imports()
    # A package imports its own __init__ when a submodule loads: only module-to-module edges count.
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle.extend(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
                return True
            if nxt not in state and visit(nxt, [*path, nxt]):
                return True
        state[node] = 2
        return False

    for start in sorted(edges):
        if start not in state and visit(start, [start]):
            break
    assert cycle == [], " -> ".join(cycle)


def test_imports_are_absolute():
    """The graph above reads absolute imports only: a relative one would slip past it."""
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert relative == [], relative


def test_modules_stay_small():
    """One idea a module: none of the tool's modules grows past 400 lines."""
    long = {
        str(path.relative_to(ROOT)): n
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 400
    }
    assert long == {}, long


def test_no_family_is_named_outside_its_package():
    """A model family is one package under runtime/models/ and one FAMILIES entry: no module
    elsewhere compares anything with a family's name, pipeline or class names."""
    from runtime.models.families import FAMILIES

    names = set(FAMILIES)
    for family in FAMILIES.values():
        names |= {*family.PIPELINES, family.TRANSFORMER_CLASS, family.VAE_CLASS}
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.is_relative_to(ROOT / "runtime" / "models"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Compare):
                    operands = [node.left, *node.comparators]
                    for leaf in (n for o in operands for n in ast.walk(o)):
                        if isinstance(leaf, ast.Constant) and leaf.value in names:
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {leaf.value!r}")
    assert found == [], found


def test_fmt_skip_only_on_data_tables():
    """`ruff format` owns the layout: the skip marker only ends a data table (a module- or
    class-level assignment of a dict, list, tuple or set display), never packs code."""
    mark, found = "# fmt" + ": skip", []  # spelled apart: this file does not count itself
    for folder in (*PACKAGES, "tests", "benchmarks", "tiny_wan"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "fmt: skip" not in text:
                continue
            tree = ast.parse(text)
            bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
            tables = {
                n.end_lineno
                for body in bodies
                for n in body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                and isinstance(n.value, (ast.Dict, ast.List, ast.Tuple, ast.Set))
            }
            found += [
                f"{path.relative_to(ROOT)}:{n}"
                for n, line in enumerate(text.splitlines(), 1)
                if mark in line and n not in tables
            ]
    assert found == [], found


def test_no_strategy_is_compared_by_name():
    """A strategy is an object (planner/strategy.py) that the planner, the runtime and the CLI
    ask: no module outside the strategies' own packages compares a strategy with a name."""
    own = (ROOT / "planner" / "strategies", ROOT / "runtime" / "strategies")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in (*PACKAGES, "tests", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if not any(path.is_relative_to(o) for o in own)
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bstrategy\s*(==|!=)", line)
    ]
    assert found == [], found


def test_every_family_provides_the_whole_protocol():
    """A family is one package: whatever the runtime, the registry and the planner ask of a
    family (runtime/models/families.py `Family`) each package has, and the model class of its
    `loop` module has every method the denoising loop calls (`FamilyModel`)."""
    import importlib
    import inspect

    from runtime.models.families import FAMILIES, Family, FamilyModel

    wanted = {n for n in dir(Family) if not n.startswith("_")} | set(Family.__annotations__)
    assert {"load_model", "install", "vae_chunks", "dir_variant", "TRANSFORMER_CLASS"} <= wanted  # read right
    methods = {n for n, v in vars(FamilyModel).items() if callable(v) and not n.startswith("_")}
    assert {"encode_text", "forward", "vae_input"} <= methods
    for name, family in FAMILIES.items():
        assert sorted(n for n in wanted if not hasattr(family, n)) == [], name
        loop = importlib.import_module(f"{family.__name__}.loop")
        models = [
            v
            for v in vars(loop).values()
            if inspect.isclass(v) and v.__module__ == loop.__name__ and hasattr(v, "forward")
        ]
        assert len(models) == 1, (name, models)
        assert sorted(m for m in methods if not hasattr(models[0], m)) == [], name


def test_no_script_folder_shadows_the_standard_library():
    """A script run as `python benchmarks/X.py` puts its folder first on sys.path: a module there
    named as a standard one (queue.py) would be imported by torch in its place."""
    import sys

    found = [
        str(path.relative_to(ROOT))
        for folder in ("benchmarks", "scripts", "tiny_wan")
        for path in (ROOT / folder).glob("*.py")
        if path.stem in sys.stdlib_module_names
    ]
    assert found == [], found
