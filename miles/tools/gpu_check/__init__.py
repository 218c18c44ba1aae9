"""GPU checks of miles on one machine without Ray or SGLang: `bash scripts/gpu-check.sh` (or
`python -m miles.tools.gpu_check`, from the repository root with PYTHONPATH=. when miles is not installed).

1. train step: miles's FSDP2 trainer (world size 1) on a Qwen3-architecture model with random weights, in bf16:
   loss finite, step time, tokens/s, MFU;
2. refit: the embedded engine (`python -m miles.engines.local --device cuda`) refit through CUDA-IPC handles
   with miles's bucket code; every tensor bit-equal, seconds per GB, handles carrying the device UUID; then a short
   generation whose log-probs match the trainer's forward;
3. varlen: the packed `miles_varlen` forward against per-sequence forwards.

`--device cpu` runs the same checks on CPU (fp32, tiny model): tests/integration/test_gpu_check.py does, so the
script cannot rot without a GPU.
"""
