#!/usr/bin/env bash
# Set up .venv/ if needed, then lint, build the manual (docs/, strict: a broken link or a
# page left out of it fails) and run the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # keeps the torch build it was set up with
VENV="${DITANGO_VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
"$VENV/bin/python" -m pytest -q --durations=25 "$@"
