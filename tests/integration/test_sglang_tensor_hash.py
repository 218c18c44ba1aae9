"""Our weight checksums against SGLang 0.5.23's own code, in its venv: the CPU path of `tensor_hash`
(sglang/srt/managers/mm_utils.py) and the CUDA path's triton kernel (`gpu_tensor_hash`), which runs here on CPU
under triton's interpreter (TRITON_INTERPRET=1; `python -O` drops its `is_cuda` asserts, nothing else changes)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from miles.utils.weight_checksum import cuda_tensor_hash, tensor_checksum

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("MILES_SGLANG_VENV", ROOT / ".venv-sglang"))
# stand-ins for modules SGLang imports but a CPU venv lacks
SHIM = ROOT / "tests" / "sglang_conformance" / "shim"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.side_venv(VENV, ".miles-sglang-ok", "bash scripts/sglang-venv.sh"),
]

SCRIPT = """
import json, sys, torch
from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash
from sglang.srt.managers.mm_utils import tensor_hash
tensors = torch.load(sys.argv[1])
print(json.dumps([[gpu_tensor_hash(t), tensor_hash(t)] for t in tensors]))
"""


def test_checksums_equal_sglangs_own_hashes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(8192 * 3 + 5, generator=g).to(torch.bfloat16),  # 2 tiles, the last partial
        torch.randn(8192 + 3, generator=g),  # fp32 across a tile boundary
        torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),  # padded to whole words
        torch.randn(64, 48, generator=g).to(torch.bfloat16),
    ]
    path = tmp_path / "tensors.pt"
    torch.save(tensors, path)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SHIM)}
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-O", "-c", SCRIPT, str(path)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    for t, (gpu, cpu) in zip(tensors, theirs, strict=True):
        assert cuda_tensor_hash(t) == gpu, (t.dtype, t.shape)
        assert tensor_checksum(t, "cuda") == f"{gpu:016x}"
        assert tensor_checksum(t, "sha256") == f"{cpu:016x}"
