#!/usr/bin/env bash
# A tiny GRPO run on CPU: a randomly initialised Qwen3-architecture model (built locally, with a locally trained
# tokenizer) learns the toy "echo" task (answer the digit in the prompt) through the real system: Ray driver,
# embedded SGLang-protocol engines behind sglang-router, FSDP2 training actors (2 CPU workers, gloo), bucketed
# colocated refit. Installs what it needs first. Extra arguments are passed to `miles.train`.
# Output: one line per rollout, metrics in $RUN_DIR/metrics.jsonl, a DCP checkpoint in $RUN_DIR/ckpt.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MILES_SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh test
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=1

ART=${MILES_TINY_DIR:-artifacts/tiny}
RUN_DIR=${RUN_DIR:-runs/tiny-$(date -u +%Y%m%d-%H%M%S)}
if [ ! -f "$ART/model/config.json" ]; then
  python3 -m miles.tools.tiny_model --out "$ART/model" --task echo --seed 0 --overwrite
fi
if [ ! -f "$ART/echo.jsonl" ]; then
  python3 -m miles.tools.toy_data --task echo --out "$ART/echo.jsonl" --n 2000 --seed 0
fi

python3 -m miles.train \
  --hf-checkpoint "$ART/model" \
  --prompt-data "$ART/echo.jsonl" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle \
  --rm-type math \
  --num-rollout "${NUM_ROLLOUT:-60}" --rollout-batch-size 16 --n-samples-per-prompt 8 \
  --rollout-max-response-len 2 --rollout-temperature 1.0 \
  --global-batch-size 128 --micro-batch-size 32 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
  --optimizer adam --lr 5e-3 --lr-decay-style constant --clip-grad 1.0 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 2 --colocate --rollout-num-gpus-per-engine 1 \
  --train-backend fsdp --update-weight-buffer-size 1048576 \
  --save "$RUN_DIR/ckpt" --save-interval 10 \
  --run-dir "$RUN_DIR" --seed 1 \
  "$@"
echo "metrics: $RUN_DIR/metrics.jsonl"
