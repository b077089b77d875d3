"""The shape of a schema-1 record (an item's sidecar, a run or task report) as far as its
readers rely on it: `ditango report`, `status`, resume and the aggregate read these files back
and format their fields, so a field of another type (a string where a number is, a list where
an object is) makes the whole record damaged, never a traceback in a reader.

Each check takes a value and says whether it fits; a missing key is a None value.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from runtime.report import SCHEMA, TIMING_SUMS

Check = Callable[[object], bool]
STATUSES = ("running", "done", "failed", "skipped")


def number(v) -> bool:
    """A finite JSON number (a 400-digit integer is none: it has no float)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) < 2**63
    return isinstance(v, float) and math.isfinite(v)


# Linux's largest pid_max (PID_MAX_LIMIT on 64-bit): a larger or non-positive "pid" is no
# process's, and os.kill would take 0 and -1 for process groups.
PID_LIMIT = 2**22


def a_pid(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= PID_LIMIT


def maybe(check: Check) -> Check:
    return lambda v: v is None or check(v)


def of_type(*types: type) -> Check:
    return lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def obj(fields: dict[str, Check], values: Check | None = None) -> Check:
    """A JSON object whose named `fields` fit (missing ones are None), and whose every value
    fits `values` when given."""

    def fits(v) -> bool:
        return (
            isinstance(v, dict)
            and all(check(v.get(k)) for k, check in fields.items())
            and (values is None or all(values(x) for x in v.values()))
        )

    return fits


def list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


_count = maybe(number)
ITEM = obj(
    {
        "id": of_type(str),
        "status": lambda v: v in STATUSES,
        "timing": maybe(obj({"total_s": _count})),
        "comm": maybe(
            obj({"inter_node_bytes": _count, "intra_node_bytes": _count, "by_purpose": maybe(of_type(dict))})
        ),
        "attention": maybe(obj({"computed_fraction_all_steps": _count})),
        "quality": maybe(obj({"psnr": _count})),
        "step_cache": maybe(
            obj({"block_fraction": number, "skipped_steps": maybe(obj({}, values=list_of(of_type(int))))})
        ),
        "method": maybe(of_type(dict)),
        "attempts": maybe(of_type(int)),
        "error": maybe(of_type(str)),
        "video_sha256": maybe(of_type(str)),
        "queue": maybe(obj({"token": of_type(int), "batch": of_type(str), "label": maybe(of_type(str))})),
    }
)
CALIBRATION = obj(
    {
        "calibrated_psnr": _count,
        "cache_ratio": number,
        "target_psnr": number,
        "planner": of_type(str),
        "item": of_type(str),
        "trials": of_type(list),
        "recalibrated": maybe(of_type(list)),
    }
)
REPORT = obj(
    {
        "items": list_of(ITEM),
        "layout": maybe(of_type(dict)),
        "calibration": maybe(CALIBRATION),
        "timing": maybe(obj({**dict.fromkeys(TIMING_SUMS, _count), "per_report": maybe(of_type(dict))})),
        "started_at": maybe(of_type(str)),
        "counts": maybe(obj({}, values=of_type(int))),
    }
)


HEARTBEAT = obj(
    {
        "state": of_type(str),
        "updated": lambda v: number(v) and 0 <= v < 1e11,
        "pid": maybe(a_pid),
        "host": maybe(of_type(str)),
        "done": maybe(of_type(int)),
        "failed": maybe(of_type(int)),
        "item_index": maybe(of_type(int)),
    }
)


def well_formed(data) -> bool:
    """A record's shape: a report (it lists items) or an item's sidecar (it has an id), of
    this schema."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return False
    if "items" in data:
        return REPORT(data)
    return "id" not in data or ITEM(data)
