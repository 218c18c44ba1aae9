#!/usr/bin/env bash
# The GPU numbers of record, in one call of at most ~8 minutes on one GPU: scripts/gpu-check.sh on a Qwen3-1.7B
# shape in bf16 with packed micro-batches of 8k and 16k tokens (32 samples of up to 2048 tokens per step; the
# best varlen kernel at hand: flash-attn, else torch's own), tokens/s and MFU of the train step, the torch profile
# of the 16k step, CUDA-IPC refit seconds per GB and engine-vs-trainer log-probs in bf16.
# Usage: bash scripts/gpu-numbers.sh [OUT_DIR]  (JSON results and the profile table land in OUT_DIR).
# `--device cpu` variants of every check run in tests/integration/test_gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-numbers}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
common=(--preset 1.7b --dtype bfloat16 --seq-len 2048 --num-seqs 32)
rc=0
# side by side in one run: HF's eager elementwise ops (--no-fused-elementwise) at 16k, then the default
bash scripts/gpu-check.sh "${common[@]}" --max-tokens-per-mb 16384 --checks train --eager --json "$out/16k-eager.json" || rc=1
bash scripts/gpu-check.sh "${common[@]}" --max-tokens-per-mb 8192 --checks train,varlen --json "$out/8k.json" || rc=1
bash scripts/gpu-check.sh "${common[@]}" --max-tokens-per-mb 16384 --checks train,varlen,refit \
  --profile "$out/profile-16k.txt" --json "$out/16k.json" || rc=1
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
for name in ("16k-eager", "8k", "16k"):
    path = Path(sys.argv[1]) / f"{name}.json"
    if not path.exists():
        print(f"{name}: no results")
        continue
    for r in json.loads(path.read_text())["results"]:
        print(f"{name:>9} [{'PASS' if r['passed'] else 'FAIL'}] {r['name']}: {r['summary']}")
PY
exit $rc
