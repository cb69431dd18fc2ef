#!/usr/bin/env bash
# Set up kiln in ./.venv: torch first (the CPU build where there is no NVIDIA GPU, so pip does
# not pull a multi-GB CUDA build), then kiln with all extras. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.6,<3"
  else
    # KILN_TORCH lets a CPU machine elsewhere pick its own CPU wheel spec or index options.
    "${PIP[@]}" ${KILN_TORCH:-torch==2.13.0}
  fi
fi
"${PIP[@]}" -e ".[all]"
