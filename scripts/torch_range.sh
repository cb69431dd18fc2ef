#!/usr/bin/env bash
# Run kiln's tests under another torch release of the declared range (torch>=2.6,<3), in its own
# venv next to .venv: scripts/torch_range.sh 2.6.0 [pytest args]  ->  .venv-torch2.6.0/
# Without pytest args it runs the whole suite (-q). PyPI's x86_64 wheels are CUDA builds (~3 GB
# with their nvidia-* dependencies) that also run on a CPU; KILN_TORCH_INDEX names another index
# (e.g. https://download.pytorch.org/whl/cpu) for the CPU build. Safe to rerun: an existing venv
# with that torch is reused, and kiln's extras are installed under a pin, so they never move torch.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:?usage: scripts/torch_range.sh TORCH_VERSION [pytest args...]}
shift
VENV=.venv-torch$V
PY=$VENV/bin/python
[ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$V')" 2>/dev/null; then
  "${PIP[@]}" ${KILN_TORCH_INDEX:+--index-url "$KILN_TORCH_INDEX"} "torch==$V"
fi
# the installed distribution's version (torch.__version__ may carry a local tag PyPI's metadata lacks)
echo "torch==$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")" > "$VENV/torch-pin.txt"
# The newest torchao (0.18) does not import with older torch, and transformers imports torchao when it
# is there, so the Hugging Face interop fails with it too: 2.6 runs with torchao 0.10.0, 2.7 with
# 0.12.0, 2.8 with 0.13.0 and 2.9 with 0.15.0 (checked: docs/torch-range.md). Other releases get the newest.
case "$V" in
  2.6.*) echo "torchao==0.10.0" >> "$VENV/torch-pin.txt" ;;
  2.7.*) echo "torchao==0.12.0" >> "$VENV/torch-pin.txt" ;;
  2.8.*) echo "torchao==0.13.0" >> "$VENV/torch-pin.txt" ;;
  2.9.*) echo "torchao==0.15.0" >> "$VENV/torch-pin.txt" ;;
esac
"${PIP[@]}" -c "$VENV/torch-pin.txt" -e ".[all]"
"$PY" -c "import torch; print('scripts/torch_range.sh: torch', torch.__version__)"
if [ $# -eq 0 ]; then set -- -q; fi
exec "$PY" -m pytest "$@"
