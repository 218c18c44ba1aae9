#!/usr/bin/env bash
# Makes .venv-trl: Hugging Face TRL (the version scripts/bench/vs_trl.py pins) over the system torch and
# transformers, for the benchmark and for tests/integration/test_grad_vs_trl.py (miles' GRPO gradient against
# TRL's on one batch). vs_trl.ensure_trl_venv does the work: --system-site-packages and a constraint file pinning
# torch and transformers, so pip never pulls a CUDA build. Cached by a stamp; a second run takes a second.
# Exit 0 with a message when TRL cannot be installed (no network): that test then skips and says why.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MILES_TRL_VENV:-.venv-trl}
if PYTHONPATH=scripts/bench "$PY" -c "
import sys
from pathlib import Path
import vs_trl
print('[trl-venv]', vs_trl.ensure_trl_venv(Path(sys.argv[1]), vs_trl.TRL_VERSION))
" "$VENV"; then
  echo "[trl-venv] $VENV is ready"
else
  echo "[trl-venv] cannot make $VENV: tests/integration/test_grad_vs_trl.py will skip"
fi
exit 0
