#!/usr/bin/env bash
# GRPO on Qwen3-4B with the FSDP2 backend, colocated with SGLang engines, on one 8-GPU node: the reference miles
# recipe (its scripts/run-qwen3-4B-fsdp.sh), flag for flag, so that reward curves compare with the reference's.
# tests/integration/test_launch_scripts.py checks the flags against a recorded copy of the reference's.
# Expects the model under /root/Qwen3-4B and the data under /root/dapo-math-17k (download them beforehand; miles
# never fetches models or data by itself). `--load /root/Qwen3-4B` holds no checkpoint: the run starts from the HF
# weights and says so. Nothing is saved (no --save), as in the reference; add `--save DIR --save-interval N`.
# Extra arguments are appended, e.g. `bash scripts/run-qwen3-4B-fsdp.sh --dry-run`.
set -euo pipefail
cd "$(dirname "$0")/.."

CKPT_ARGS=(
  --hf-checkpoint /root/Qwen3-4B
  --load /root/Qwen3-4B
  --ref-load /root/Qwen3-4B
)
ROLLOUT_ARGS=(
  --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
  --input-key prompt --label-key label --apply-chat-template
  --rollout-shuffle --balance-data --rm-type deepscaler
  --num-rollout 100 --rollout-batch-size 8 --n-samples-per-prompt 8
  --rollout-max-response-len 4096 --rollout-temperature 1
  --global-batch-size 64
)
GRPO_ARGS=(
  --use-kl-loss --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
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
  --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.75 --sglang-decode-log-interval 1000
  --sglang-chunked-prefill-size 4096 --sglang-attention-backend fa3
)
TRAIN_BACKEND_ARGS=(
  --train-backend fsdp --update-weight-buffer-size 536870912 --gradient-checkpointing
  --attn-implementation flash_attention_3
  --train-env-vars '{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}'
)
PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 9216)
MISC_ARGS=(
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
  --use-fault-tolerance
  --dump-details /root/shared_data/qwen3-4B-fsdp-1116-noref/dump_details
)

# A longer variant (the values this script used to run): append these to override the reference's.
#   --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
#   --num-rollout 3000 --rollout-batch-size 32 --rollout-max-response-len 8192 --global-batch-size 256
#   --load /root/Qwen3-4B_miles/ --save /root/Qwen3-4B_miles/ --save-interval 20
#   --eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
#   --n-samples-per-eval-prompt 16 --eval-max-response-len 16384

python3 -m miles.train \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${GRPO_ARGS[@]}" "${WANDB_ARGS[@]}" \
  "${SGLANG_ARGS[@]}" "${TRAIN_BACKEND_ARGS[@]}" "${PERF_ARGS[@]}" "${MISC_ARGS[@]}" "$@"
