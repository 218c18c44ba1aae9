#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-3B-Instruct with the FSDP2 backend, colocated with SGLang engines, on one 8-GPU node: the
# Geo3K vision-language recipe (issue 27), with the reference miles VL recipe's values where it has them (Geo3K
# layout: an image list, a problem and an answer per row; --multimodal-keys '{"image": "images"}'; math rewards).
# Expects the model under /root/Qwen2.5-VL-3B-Instruct (its HF directory: weights, tokenizer, preprocessor
# config) and Geo3K under /root/geo3k_imgurl/{train,test}.parquet (download them beforehand; miles never fetches
# models or data, and refuses image URLs: the rows must hold the images themselves, bytes or base64).
# The engines are `--rollout-engine auto`: SGLang on a GPU machine with sglang installed. SGLang serving a VL
# model is UNTESTED HERE: the /generate image_data shape and the refit names are checked against SGLang 0.5.23's
# source (tests/integration/test_sglang_vl_conformance.py, tests/unit/test_refit_vl_names.py), but no run with
# SGLang engines was made; the whole loop is tested on CPU with the embedded engine (docs/vlm.md).
# tests/integration/test_launch_scripts.py parses these flags. Add `--freeze-vision-tower` to train the language
# model only. Extra arguments are appended, e.g. `bash scripts/run-qwen2.5-vl-3b-fsdp.sh --dry-run`.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=/root/Qwen2.5-VL-3B-Instruct
DATA=/root/geo3k_imgurl
CKPT_ARGS=(--hf-checkpoint "$MODEL")
ROLLOUT_ARGS=(
  --prompt-data "$DATA/train.parquet"
  --input-key problem --label-key answer --multimodal-keys '{"image": "images"}' --apply-chat-template
  --rollout-shuffle --rm-type math
  --num-rollout 3000 --rollout-batch-size 64 --n-samples-per-prompt 8
  --rollout-max-response-len 4096 --rollout-temperature 1
  --global-batch-size 512
)
EVAL_ARGS=(
  --eval-interval 20 --eval-prompt-data geo3k "$DATA/test.parquet"
  --n-samples-per-eval-prompt 1 --eval-max-response-len 4096 --eval-top-k 1
)
GRPO_ARGS=(
  --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
WANDB_ARGS=()
if [ -n "${WANDB_API_KEY:-}" ]; then
  WANDB_ARGS=(--use-wandb --wandb-project miles-dev --wandb-group qwen2.5-vl-3b-fsdp --wandb-key "${WANDB_API_KEY}")
fi
SGLANG_ARGS=(--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.6)
TRAIN_BACKEND_ARGS=(
  --train-backend fsdp --update-weight-buffer-size 536870912 --gradient-checkpointing
  --train-env-vars '{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}'
)
PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 9216)
MISC_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate)

python3 -m miles.train \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${WANDB_ARGS[@]}" "${SGLANG_ARGS[@]}" "${TRAIN_BACKEND_ARGS[@]}" "${PERF_ARGS[@]}" "${MISC_ARGS[@]}" "$@"
