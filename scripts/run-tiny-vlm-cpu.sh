#!/usr/bin/env bash
# A tiny vision-language GRPO run on CPU (issue 27): a randomly initialised Qwen2.5-VL-architecture model
# (miles.tools.tiny_vlm) learns a toy image task (TASK, default "bright_dark": answer 1 for a bright 56x56 image, 0
# for a dark one, the same prompt for every row, so only the image tells the answer; or "read_digit",
# "count_shapes") through the real system: images in the data (--multimodal-keys), in the /generate requests
# (image_data) and in the packed trainer forward; embedded engines running the VL model; colocated refit under
# SGLang's VL loader names.
# NUM_ROLLOUT, ROLLOUT_BATCH_SIZE (prompts per rollout, 8 samples each), MAX_RESPONSE_LEN and LR override the
# defaults (14 rollouts of 8 prompts, one-token answers, lr 2e-2: about a minute on 2 cores, docs/vlm.md).
# Set FREEZE_VISION=1 to train the language model only (--freeze-vision-tower). Extra arguments go to `miles.train`.
# Output: one line per rollout, metrics in $RUN_DIR/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MILES_SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh test
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=1

ART=${MILES_TINY_VLM_DIR:-artifacts/tiny-vlm}
RUN_DIR=${RUN_DIR:-runs/tiny-vlm-$(date -u +%Y%m%d-%H%M%S)}
if [ ! -f "$ART/model/config.json" ]; then
  python3 -m miles.tools.tiny_vlm --out "$ART/model" --kind "${VLM_KIND:-qwen2_5_vl}" --seed 0 --overwrite
fi
TASK=${TASK:-bright_dark}
if [ ! -f "$ART/$TASK.jsonl" ]; then
  python3 -m miles.tools.toy_data --task "$TASK" --out "$ART/$TASK.jsonl" --n 1000 --seed 0
fi
FREEZE=()
[ "${FREEZE_VISION:-0}" = 1 ] && FREEZE=(--freeze-vision-tower)

python3 -m miles.train \
  --hf-checkpoint "$ART/model" \
  --prompt-data "$ART/$TASK.jsonl" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle \
  --multimodal-keys '{"image": "images"}' "${FREEZE[@]}" \
  --rm-type math \
  --num-rollout "${NUM_ROLLOUT:-14}" --rollout-batch-size "${ROLLOUT_BATCH_SIZE:-8}" --n-samples-per-prompt 8 \
  --rollout-max-response-len "${MAX_RESPONSE_LEN:-1}" --rollout-temperature 1.0 \
  --global-batch-size "$((${ROLLOUT_BATCH_SIZE:-8} * 8))" --micro-batch-size 32 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
  --optimizer adam --lr "${LR:-2e-2}" --lr-decay-style constant --clip-grad 1.0 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 2 --colocate --rollout-num-gpus-per-engine 1 \
  --train-backend fsdp --update-weight-buffer-size 1048576 \
  --run-dir "$RUN_DIR" --seed 1 \
  "$@"
echo "metrics: $RUN_DIR/metrics.jsonl"
