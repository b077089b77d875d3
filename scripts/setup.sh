#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at .venv/ and install
# ditango into it in editable mode with the dev extras.
#
# torch is taken through constraints/cpu.txt (torch==2.13.0) so CPU machines get
# the CPU wheel instead of a multi-GB CUDA build. On a GPU machine set
# DITANGO_CONSTRAINTS to another file (or to an empty string) to keep your torch.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
CONSTRAINTS="${DITANGO_CONSTRAINTS-constraints/cpu.txt}"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi

# Skip the install when nothing it depends on changed since the last one.
stamp=.venv/.ditango-setup
want="$(cat pyproject.toml "${CONSTRAINTS:-/dev/null}" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/ditango ]; then
    exit 0
fi

pip_args=(--quiet --disable-pip-version-check)
if [ -n "$CONSTRAINTS" ]; then
    pip_args+=(-c "$CONSTRAINTS")
    # Install the pinned torch first so no other requirement pulls a different build.
    .venv/bin/python -m pip install "${pip_args[@]}" torch
fi
.venv/bin/python -m pip install "${pip_args[@]}" -e ".[dev]"
echo "$want" > "$stamp"
