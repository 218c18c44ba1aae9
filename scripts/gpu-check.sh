#!/usr/bin/env bash
# GPU checks on one GPU, without Ray, SGLang or an installed miles (needs torch, transformers, fastapi, uvicorn,
# httpx; triton and flash-attn when present): an FSDP2 bf16 train step of a Qwen3-shaped model with random
# weights (tokens/s, MFU), CUDA-IPC refit into the embedded engine on the GPU (bit-equal tensors, s/GB) with a
# log-prob check of its samples, and the packed varlen forward against per-sequence forwards.
# Prints a report; exits 1 when a check fails. Options: bash scripts/gpu-check.sh --help
# (`--device cpu` runs the same checks on CPU with a tiny model, as tests/integration/test_gpu_check.py does).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" -m miles.tools.gpu_check "$@"
