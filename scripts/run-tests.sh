#!/usr/bin/env bash
# The test suite on a CPU-only machine: installs what it needs, then runs every test except GPU ones.
# Extra pytest arguments pass through, e.g. `bash scripts/run-tests.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
bash scripts/sglang-venv.sh  # .venv-sglang for the SGLang conformance suite (cached; skips the suite if it fails)
bash scripts/trl-venv.sh  # .venv-trl for the GRPO gradient cross-check against TRL (cached; skips that test if it fails)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m pytest tests -m "not gpu" -p no:cacheprovider --durations=15 "$@"
