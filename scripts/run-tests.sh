#!/usr/bin/env bash
# The test suite on a CPU-only machine: installs what it needs, then runs every test except GPU ones.
# Extra pytest arguments pass through, e.g. `bash scripts/run-tests.sh -m "not slow"`; given test paths, only those
# run (`bash scripts/run-tests.sh tests/integration/test_grad_vs_trl.py`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# Side venvs over this Python's packages (scripts/side_venv.py; cached). Without one, its tests skip and say why;
# under CI=true they fail instead.
bash scripts/sglang-venv.sh  # .venv-sglang: the SGLang conformance suite
bash scripts/trl-venv.sh  # .venv-trl: miles' GRPO gradient and settings against TRL's
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
targets=(tests)
for a in "$@"; do if [ -e "${a%%::*}" ]; then targets=(); break; fi; done
exec "${PYTHON:-python3}" -m pytest ${targets[@]+"${targets[@]}"} -m "not gpu" -p no:cacheprovider --durations=15 "$@"
