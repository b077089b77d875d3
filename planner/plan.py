"""The DiTango plan record: per step, which remote (layer, unit) cells are computed fresh.

Shape legend: L transformer layers, U remote units (groups of the ring, possibly composed),
addressed by ring offset so the same plan holds on every rank (docs/ALGORITHMS.md 2.1).

A `PlanLog` is what the report stores: a JSON-ready summary, a lossless JSON form, and a
sha256 of a canonical encoding. Every rank hashes its own log; equal hashes prove that
the communication pattern was rank-invariant.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["exact", "anchor", "selective"]
KINDS: tuple[str, ...] = ("exact", "anchor", "selective")
JSON_FORMAT = "ditango-plan-log/1"


@dataclass
class StepPlan:
    step: int
    kind: Kind
    compute_LU: torch.Tensor  # bool [L, U]; True = COMPUTE (fetch fresh), False = REUSE (cached state)
    epsilon: float | None  # ASE threshold in force; None before the first selective step of an anchor window

    def __repr__(self) -> str:
        layers, units = self.compute_LU.shape
        computed = int(self.compute_LU.sum())
        return f"StepPlan(step={self.step}, kind={self.kind}, computed={computed}/{layers * units}, epsilon={self.epsilon})"

    def fingerprint(self) -> int:
        """A 62-bit integer of what decides the step's communication (step, kind, compute
        bits): equal on every rank exactly when their exchanges pair up."""
        canon = json.dumps([self.step, self.kind, list(self.compute_LU.shape), _bits(self.compute_LU)])
        return int.from_bytes(hashlib.sha256(canon.encode()).digest()[:8], "big") >> 2


def _fraction(compute: torch.Tensor) -> float:
    """Fraction of cells computed; 1.0 for no cells (nothing remote: everything is exact)."""
    if compute.numel() == 0:
        return 1.0
    return round(float(compute.float().mean()), 6)


def _mean_fraction(computes: list[torch.Tensor]) -> float:
    """Computed cells / all cells over several steps; 1.0 for no cells (everything exact)."""
    cells = sum(c.numel() for c in computes)
    return round(sum(int(c.sum()) for c in computes) / cells, 6) if cells else 1.0


def _bits(compute_LU: torch.Tensor) -> list[str]:
    """One '0'/'1' string per layer, unit 0 first."""
    return ["".join("1" if b else "0" for b in row) for row in compute_LU.tolist()]


def _from_bits(rows: list[str]) -> torch.Tensor:
    assert all(set(r) <= {"0", "1"} for r in rows), rows
    assert len({len(r) for r in rows}) <= 1, "ragged compute rows"
    if not rows:
        return torch.zeros(0, 0, dtype=torch.bool)
    return torch.tensor([[c == "1" for c in r] for r in rows], dtype=torch.bool)  # [L, U], also for U = 0


@dataclass
class PlanLog:
    steps: list[StepPlan]

    def summary(self) -> dict:
        """JSON-ready numbers for the report (fractions rounded to 6 decimals).

        epsilon: one entry per anchor window, the threshold that governed its selective
        plans (None when no plan of the window used one, e.g. the gate fired right away).
        computed_fraction_all_steps: computed cells / all cells over every step, exact,
        anchor and selective (what the bytes follow); computed_fraction_selective: the same
        over selective steps only (None without one). computed_fraction_by_unit: the
        all-steps figure per unit. steps: how many steps of each kind.
        """
        anchors = [p.step for p in self.steps if p.kind == "anchor"]
        windows: list[dict] = []
        for p in self.steps:
            if p.kind == "anchor":
                windows.append({"anchor": p.step, "epsilon": None})
            elif p.kind == "selective" and p.epsilon is not None and windows and windows[-1]["epsilon"] is None:
                windows[-1]["epsilon"] = p.epsilon
        selective = [p.compute_LU for p in self.steps if p.kind == "selective"]
        every = [p.compute_LU for p in self.steps]
        by_unit = None
        if every and every[0].numel():
            by_unit = [round(float(u), 6) for u in torch.stack(every).float().mean(dim=(0, 1))]
        return {
            "anchors": anchors,
            "epsilon": windows,
            "kinds": [p.kind for p in self.steps],
            "steps": {kind: sum(p.kind == kind for p in self.steps) for kind in KINDS},
            "compute_map": [[_fraction(row) for row in p.compute_LU] for p in self.steps],
            "per_step": [_fraction(p.compute_LU) for p in self.steps],
            "computed_fraction_all_steps": _mean_fraction(every),
            "computed_fraction_selective": _mean_fraction(selective) if selective else None,
            "computed_fraction_by_unit": by_unit,
        }

    def to_json(self) -> dict:
        """Lossless JSON form (epsilon as a full float; compute as bit strings per layer)."""
        return {
            "format": JSON_FORMAT,
            "steps": [
                {"step": p.step, "kind": p.kind, "epsilon": p.epsilon, "compute": _bits(p.compute_LU)}
                for p in self.steps
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> PlanLog:
        if d.get("format") != JSON_FORMAT:
            raise ValueError(f"not a DiTango plan log: format={d.get('format')!r}, expected {JSON_FORMAT!r}")
        steps = []
        for s in d["steps"]:
            if s["kind"] not in KINDS:
                raise ValueError(f"unknown plan kind {s['kind']!r} at step {s['step']}; expected one of {KINDS}")
            eps = None if s["epsilon"] is None else float(s["epsilon"])
            steps.append(StepPlan(int(s["step"]), s["kind"], _from_bits(s["compute"]), eps))
        return cls(steps)

    def hash(self) -> str:
        """sha256 hex of a canonical JSON: kind, epsilon (9 significant digits) and compute
        bits of every step. Rounding epsilon keeps the hash a statement about decisions, not
        about the last ulp of a float that was printed and parsed on the way."""
        canon = [
            {
                "step": p.step,
                "kind": p.kind,
                "epsilon": None if p.epsilon is None else f"{p.epsilon:.9g}",
                "shape": list(p.compute_LU.shape),
                "compute": _bits(p.compute_LU),
            }
            for p in self.steps
        ]
        blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode("ascii")).hexdigest()

    def __repr__(self) -> str:
        anchors = [p.step for p in self.steps if p.kind == "anchor"]
        return f"PlanLog(steps={len(self.steps)}, anchors={anchors})"
