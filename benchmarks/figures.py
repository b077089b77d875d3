"""Redraw every benchmark figure from the results the benchmarks kept, without rerunning
them: run_all.py's results.json (bars), fidelity.py's fidelity.json and ditango.py's rows
(ditango.json when it was written with --json, else the table ditango.md it always writes).

    python benchmarks/figures.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import ditango, fidelity, run_all  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def ditango_rows(folder: Path) -> list[dict]:
    """ditango.py's rows: its JSON, or read back from its markdown table (the columns its
    `table` writes; "inf" PSNR: every prompt identical to the ring's)."""
    if (folder / "ditango.json").is_file():
        return json.loads((folder / "ditango.json").read_text())["rows"]
    rows = []
    for line in (folder / "ditango.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or not line.startswith("|") or cells[0] in ("run", "---") or set(cells[0]) <= {"-"}:
            continue
        run, planner, ratio, inter, psnr = cells[0], cells[1], cells[2], cells[3], cells[6]
        number = lambda text: None if text in ("-", "ref", "failed", "inf") else float(text.split()[0])  # noqa: E731
        sweep = planner if planner != "-" and run == f"{planner} {ratio}" else None
        rows.append(
            {
                "run": run,
                "status": "failed" if "failed" in cells else "done",
                "sweep": sweep,
                "cache_ratio": number(ratio),
                "inter_node_vs_ring": number(inter),
                "psnr_mean": number(psnr),
                "psnr_inf": psnr.startswith("inf"),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    folder = ap.parse_args().results
    written = []
    if (folder / "results.json").is_file():
        written += run_all.figures(folder, json.loads((folder / "results.json").read_text())["rows"])
    if (folder / "fidelity.json").is_file():
        written += fidelity.plots(folder, json.loads((folder / "fidelity.json").read_text())["rows"])
    if (folder / "ditango.json").is_file() or (folder / "ditango.md").is_file():
        path = folder / "ditango_bytes_vs_psnr.png"
        ditango.plot(path, ditango_rows(folder))
        written.append(path)
    print("\n".join(str(p) for p in written))


if __name__ == "__main__":
    main()
