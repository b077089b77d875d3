#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at .venv/ and install ditango into it
# in editable mode with the dev extras, with the torch build that fits where the videos will
# be made:
#   a CUDA build where they are made on NVIDIA GPUs: this machine has an NVIDIA driver
#     (nvidia-smi lists a GPU), or it is a Slurm login node whose cluster advertises GPUs
#     (sinfo shows a gpu generic resource; a login node has no GPU of its own);
#   the CPU wheel elsewhere, through constraints/cpu.txt (torch==2.13.0).
#
#   ./scripts/setup.sh [--cpu | --cuda]     force one build (or DITANGO_TORCH_BUILD=cpu|cuda)
#   ./scripts/setup.sh --which              say which build it would install, and why; install nothing
# Once set up, the build is remembered: a later run (scripts/test.sh runs this one) keeps it
# unless --cpu or --cuda says otherwise. DITANGO_VENV=DIR sets up DIR instead of .venv/.
#
# DITANGO_TORCH_INDEX=URL picks the index torch comes from. The CUDA build: PyPI by default (its
# Linux wheels are CUDA builds), e.g. https://download.pytorch.org/whl/cu126 for an older driver.
# The CPU wheel: https://download.pytorch.org/whl/cpu by default, as an extra index (PyPI's
# Linux torch is a CUDA build); empty: none (a CPU wheel on local disk, as in CI).
# DITANGO_CONSTRAINTS=FILE replaces constraints/cpu.txt on the CPU path (empty: none).
# Air-gapped: pip's own PIP_FIND_LINKS / PIP_NO_INDEX apply (docs/setup.md: "Set-up on a GPU machine or cluster").
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
build="${DITANGO_TORCH_BUILD:-}"
which_only=""
case "$build" in "" | cpu | cuda) ;; *) echo "error: DITANGO_TORCH_BUILD must be cpu or cuda, got $build" >&2; exit 2 ;; esac
for arg in "$@"; do
    case "$arg" in
        --cpu) build=cpu ;;
        --cuda) build=cuda ;;
        --which) which_only=1 ;;
        -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: setup.sh takes --cpu or --cuda, got $arg" >&2; exit 2 ;;
    esac
done

gpus_here() {
    # An NVIDIA driver that lists a GPU, or a Slurm cluster whose nodes advertise one.
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        echo "an NVIDIA GPU on this machine"
        return 0
    fi
    if command -v sinfo >/dev/null 2>&1 && timeout 20 sinfo -h -o '%G' 2>/dev/null | grep -qi 'gpu'; then
        echo "Slurm nodes that advertise GPUs"
        return 0
    fi
    return 1
}

# The build an earlier set-up chose is kept (scripts/test.sh runs this again): a machine that
# looks different now (a Slurm that advertises GPUs) never swaps a working torch behind your back.
VENV="${DITANGO_VENV:-.venv}"
remembered="$VENV/.ditango-build"
installed_build() {
    "$VENV/bin/python" -c 'import torch; print("cuda" if torch.version.cuda or torch.version.hip else "cpu")' 2>/dev/null || true
}
why="asked for"
if [ -z "$build" ] && [ -f "$remembered" ]; then
    case "$(cat "$remembered")" in
        cpu | cuda) build="$(cat "$remembered")"; why="the build $VENV was set up with; --cpu or --cuda to change it" ;;
    esac
elif [ -z "$build" ] && [ -f "$VENV/.ditango-setup" ]; then  # set up before the build was remembered
    build="$(installed_build)"
    why="the build $VENV has; --cpu or --cuda to change it"
fi
if [ -z "$build" ]; then
    if why="$(gpus_here)"; then
        build=cuda
        [ -n "$which_only" ] || echo "setup: installing a CUDA build of torch ($why; --cpu for the CPU wheel)"
    else
        build=cpu
        why="no NVIDIA GPU here and no Slurm nodes that advertise one"
    fi
fi
if [ "$build" = cpu ]; then
    INDEX="${DITANGO_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
else
    INDEX="${DITANGO_TORCH_INDEX:-}"
fi
if [ -n "$which_only" ]; then
    echo "$build ($why); torch from ${INDEX:-the indexes pip is set to}"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi

if [ "$build" = cpu ]; then
    CONSTRAINTS="${DITANGO_CONSTRAINTS-constraints/cpu.txt}"
else
    CONSTRAINTS=""
fi

# Skip the install when nothing it depends on changed since the last one, and torch imports
# as the build chosen (an install cut short leaves no torch, whatever the stamp says).
stamp="$VENV/.ditango-setup"
want="$(cat pyproject.toml "${CONSTRAINTS:-/dev/null}" <(echo "$build $INDEX") | sha256sum | cut -d' ' -f1)"
have="$(installed_build)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/ditango" ] && [ "$have" = "$build" ]; then
    exit 0
fi
rm -f "$stamp"  # written again only once this install has finished

if [ -n "$have" ] && [ "$have" != "$build" ]; then
    echo "setup: replacing the $have build of torch with a $build one"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torch
fi

pip_args=(--quiet --disable-pip-version-check)
torch_args=()
if [ -n "$CONSTRAINTS" ]; then
    pip_args+=(-c "$CONSTRAINTS")
fi
if [ -n "$INDEX" ] && [ "$build" = cpu ]; then
    torch_args+=(--extra-index-url "$INDEX")  # its +cpu wheel outranks PyPI's build of the same version
elif [ -n "$INDEX" ]; then
    torch_args+=(--index-url "$INDEX")
fi
# torch first, so that no other requirement pulls a different build.
"$VENV/bin/python" -m pip install "${pip_args[@]}" "${torch_args[@]}" torch
"$VENV/bin/python" -m pip install "${pip_args[@]}" -e ".[dev]"
if [ "$build" = cuda ] && [ "$(installed_build)" != cuda ]; then
    echo "warning: pip installed a CPU-only torch; pick a CUDA index, e.g." \
        "DITANGO_TORCH_INDEX=https://download.pytorch.org/whl/cu128 ./scripts/setup.sh --cuda" >&2
elif [ "$build" = cpu ] && [ "$(installed_build)" != cpu ]; then
    echo "warning: pip installed a CUDA build of torch for a CPU machine (it runs, but is GBs larger);" \
        "DITANGO_TORCH_INDEX=https://download.pytorch.org/whl/cpu ./scripts/setup.sh --cpu picks the CPU wheel" >&2
fi
echo "$build" > "$remembered"
echo "$want" > "$stamp"
