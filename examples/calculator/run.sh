#!/usr/bin/env bash
# Tool use on CPU: a tiny random model learns to call the calculator (multi-turn rollouts, tool tokens masked
# out of the loss). Builds the model and data first. Extra arguments go to `miles.train`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
ART=${MILES_CALC_DIR:-artifacts/calculator}
RUN_DIR=${RUN_DIR:-runs/calculator-$(date -u +%Y%m%d-%H%M%S)}
[ -f "$ART/model/config.json" ] || python3 -m examples.calculator.build --out "$ART"
python3 -m miles.train \
  --hf-checkpoint "$ART/model" --prompt-data "$ART/train.jsonl" --input-key prompt --label-key label \
  --apply-chat-template --rollout-shuffle \
  --custom-generate-function-path miles.rollout.multi_turn.generate_multi_turn \
  --generate-execute-tool-function-path examples.calculator.tool:calculator --generate-max-turns 2 \
  --custom-rm-path examples.calculator.tool:calculator_reward \
  --num-rollout "${NUM_ROLLOUT:-30}" --rollout-batch-size 16 --n-samples-per-prompt 8 \
  --rollout-max-response-len 20 --rollout-temperature 1.0 \
  --global-batch-size 128 --micro-batch-size 32 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
  --optimizer adam --lr 5e-3 --clip-grad 1.0 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 2 --colocate \
  --update-weight-buffer-size 1048576 --run-dir "$RUN_DIR" --seed 1 \
  "$@"
echo "metrics: $RUN_DIR/metrics.jsonl"
