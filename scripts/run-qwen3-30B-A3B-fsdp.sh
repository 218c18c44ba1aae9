#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (Qwen3-MoE: 128 experts, 8 routed per token) with the FSDP2 backend, colocated with SGLang
# engines, on one 8-GPU node (issue 28): rollout routing replay (R3: the engines return each token's experts and
# the trainer replays them, so the importance ratio does not measure routing noise), expert parallelism over the
# 8 training ranks (each holds 16 experts of every layer; tokens reach them by all-to-all), and the 4B recipe's
# GRPO and optimizer values (scripts/run-qwen3-4B-fsdp.sh, the reference miles recipe) otherwise, plus --use-tis
# (truncated importance sampling against the engines' log-probs: R3 removes the routing gap, not the kernels').
# Expects the model under /root/Qwen3-30B-A3B and the data under /root/dapo-math-17k (download them beforehand;
# miles never fetches models or data). With R3 the engines are launched with --enable-return-routed-experts.
# UNTESTED ON GPU HERE: R3, EP and the refit's per-expert names are tested on CPU (gloo, fp32, tiny Qwen3-MoE:
# tests/integration/test_expert_parallel*.py, test_moe_r3_trainer.py, tests/e2e/test_moe_r3_learns.py) and the
# routed-experts layout against SGLang 0.5.23's source; no run with SGLang engines on GPUs was made.
# tests/integration/test_launch_scripts.py parses these flags. Extra arguments are appended, e.g.
# `bash scripts/run-qwen3-30B-A3B-fsdp.sh --dry-run`.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=/root/Qwen3-30B-A3B
CKPT_ARGS=(--hf-checkpoint "$MODEL" --ref-load "$MODEL")
ROLLOUT_ARGS=(
  --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
  --input-key prompt --label-key label --apply-chat-template
  --rollout-shuffle --balance-data --rm-type deepscaler
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 1
  --global-batch-size 256
)
GRPO_ARGS=(
  --use-kl-loss --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
  --use-tis
)
MOE_ARGS=(
  --use-rollout-routing-replay --moe-aux-loss-coeff 0.0
  --expert-model-parallel-size 8
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 4 --sglang-mem-fraction-static 0.7 --sglang-decode-log-interval 1000
  --sglang-chunked-prefill-size 4096
)
TRAIN_BACKEND_ARGS=(
  --train-backend fsdp --update-weight-buffer-size 536870912 --gradient-checkpointing
  --train-env-vars '{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}'
)
PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 8192)
MISC_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate --use-fault-tolerance)

python3 -m miles.train \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}" "${MOE_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
  "${SGLANG_ARGS[@]}" "${TRAIN_BACKEND_ARGS[@]}" "${PERF_ARGS[@]}" "${MISC_ARGS[@]}" "$@"
