#!/usr/bin/env bash
# The venv of pfl-research 0.6 for benchmarks/peer_pfl.py, apart from fedsparse's: torch first,
# exactly (the local CPU wheel; a looser pin pulls CUDA wheels), then pfl with its PyTorch extra.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV_PFL:-.venv-pfl}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet "pfl[pytorch]==0.6.0"
echo "pfl venv ready: $VENV/bin/python"
