#!/usr/bin/env bash
# Set up .venv/ if needed, then lint and run the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q --durations=25 "$@"
