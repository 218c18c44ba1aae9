#!/usr/bin/env bash
# Makes .venv-trl: Hugging Face TRL (the version scripts/bench/vs_trl.py pins) for the benchmark and for
# tests/integration/test_grad_vs_trl.py and test_vs_trl_settings.py (miles' GRPO gradient and settings against
# TRL's). vs_trl.ensure_trl_venv does the work: a side venv of the calling Python (scripts/side_venv.py) that sees
# its torch, transformers and miles' dependencies (a venv's or the system's) and adds TRL on top, every package
# the caller has pinned to the caller's version, so pip never pulls a CUDA build. Cached by a stamp; a second run
# takes a second or two. Exit 0 with a message when TRL cannot be installed (no network): those tests then skip
# and say why, or fail under CI=true.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MILES_TRL_VENV:-.venv-trl}
if PYTHONPATH=scripts/bench "$PY" -c "
import sys
from pathlib import Path
import vs_trl
try:
    print('[trl-venv]', vs_trl.ensure_trl_venv(Path(sys.argv[1]), vs_trl.TRL_VERSION))
except RuntimeError as e:
    sys.exit(f'[trl-venv] {e}')
" "$VENV"; then
  echo "[trl-venv] $VENV is ready"
else
  echo "[trl-venv] cannot make $VENV: the TRL tests will skip (and fail under CI=true)"
fi
exit 0
