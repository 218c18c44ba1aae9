#!/usr/bin/env bash
# Installs miles and what it needs into the current Python environment. Idempotent and quick when done before.
# On a machine without an NVIDIA GPU it first installs the CPU build of torch, so that nothing later pulls the
# multi-GB CUDA build. Usage: bash scripts/install.sh [extra]   (extra: test, gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=${1:-test}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "[install] NVIDIA GPU found: installing torch from the package index"
    "$PY" -m pip install -q "torch>=2.6"
  else
    echo "[install] no GPU: installing the CPU build torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi

stamp=".install-stamp-${extra}"
want="$(cat pyproject.toml setup.py | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c "import miles, ray, transformers, sglang_router" 2>/dev/null; then
  echo "[install] pip install -e .[${extra}]"
  "$PY" -m pip install -q -e ".[${extra}]"
  echo "$want" > "$stamp"
fi
