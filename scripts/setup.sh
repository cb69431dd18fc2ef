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
# torchvision (image-text decoding, the `image` extra): the release that matches the installed torch
# (0.(minor+15) for torch 2.x), from the index torch came from - the CPU index on CPU machines,
# KILN_TORCHVISION_INDEX to override - and --no-deps, so it can never replace torch. A wheel that
# does not load (e.g. a CUDA-linked one next to a CPU torch) is removed again: kiln then decodes
# with Pillow. Never fatal: only the image-text loader's torchvision paths need it.
if ! .venv/bin/python -c "import torchvision.io" 2>/dev/null; then
  TV=$(.venv/bin/python -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'torchvision==0.{int(v[1]) + 15}.*')")
  if command -v nvidia-smi >/dev/null 2>&1; then TV_INDEX=${KILN_TORCHVISION_INDEX:-}
  else TV_INDEX=${KILN_TORCHVISION_INDEX:-https://download.pytorch.org/whl/cpu}; fi
  if "${PIP[@]}" --no-deps ${TV_INDEX:+--index-url "$TV_INDEX"} "$TV" \
      && .venv/bin/python -c "import torchvision.io" 2>/dev/null; then :
  else
    .venv/bin/python -m pip uninstall --quiet --yes torchvision 2>/dev/null || true
    echo "setup.sh: no working $TV (index ${TV_INDEX:-PyPI}); image decoding falls back to Pillow" >&2
  fi
fi
