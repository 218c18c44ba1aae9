#!/usr/bin/env bash
# GRPO on Qwen3-4B with the FSDP2 backend, colocated with SGLang engines, on one 8-GPU node.
# Expects the model under /root/Qwen3-4B and the data under /root/dapo-math-17k and /root/aime-2024
# (download them beforehand; miles never fetches models or data by itself).
# Extra arguments are appended, e.g. `bash scripts/run-qwen3-4B-fsdp.sh --dry-run`.
set -euo pipefail
cd "$(dirname "$0")/.."

CKPT_ARGS=(
  --hf-checkpoint /root/Qwen3-4B
  --ref-load /root/Qwen3-4B
  --load /root/Qwen3-4B_miles/
  --save /root/Qwen3-4B_miles/
  --save-interval 20
)
ROLLOUT_ARGS=(
  --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
  --input-key prompt --label-key label --apply-chat-template
  --rollout-shuffle --balance-data --rm-type deepscaler
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 1
  --global-batch-size 256
)
EVAL_ARGS=(
  --eval-interval 20
  --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
  --n-samples-per-eval-prompt 16 --eval-max-response-len 16384
)
GRPO_ARGS=(
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
WANDB_ARGS=()
if [ -n "${WANDB_API_KEY:-}" ]; then
  WANDB_ARGS=(--use-wandb --wandb-project miles-dev --wandb-group qwen3-4B-fsdp --wandb-key "${WANDB_API_KEY}")
fi
SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7 --sglang-decode-log-interval 1000
  --sglang-chunked-prefill-size 4096 --sglang-attention-backend fa3
)
TRAIN_BACKEND_ARGS=(
  --train-backend fsdp --update-weight-buffer-size 536870912 --gradient-checkpointing
  --attn-implementation flash_attention_3
  --train-env-vars '{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}'
)
PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 9216)

python3 -m miles.train \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
  "${WANDB_ARGS[@]}" "${SGLANG_ARGS[@]}" "${TRAIN_BACKEND_ARGS[@]}" "${PERF_ARGS[@]}" "$@"
