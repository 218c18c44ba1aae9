"""scripts/gpu-check.sh with --device cpu: the GPU checks (FSDP2 train step, refit into the embedded engine with a
log-prob check of its samples, packed varlen forward) on a tiny model in fp32, so the script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    dist_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _results(path: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(path.read_text())["results"]}


def test_gpu_check_script_on_cpu(tmp_path):
    out = tmp_path / "out.json"
    proc = _run(["bash", "scripts/gpu-check.sh", "--device", "cpu", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu-check: all 4 checks passed" in proc.stdout
    res = _results(out)
    assert sorted(res) == ["generation", "refit", "train step", "varlen"]
    assert all(r["passed"] for r in res.values())
    train = res["train step"]["numbers"]
    assert torch.isfinite(torch.tensor(train["loss"])) and train["grad_norm"] > 0
    assert train["tokens_per_s"] > 0
    assert train["first_mb_ppo_kl_abs_max"] == 0.0
    assert res["varlen"]["numbers"]["max_abs_diff"] <= 1e-5 and res["varlen"]["numbers"]["sequences"] == 4
    refit = res["refit"]["numbers"]
    assert refit["bit_equal"] == refit["tensors"] == refit["differed_before"] > 0  # the trainer took steps
    gen = res["generation"]["numbers"]
    assert gen["tokens"] == 8 * 32 and gen["max_abs_diff"] <= 1e-5
    # before the refit the engine held another seed's weights: the comparison can see a wrong weight
    assert gen["before_refit_mean_abs_diff"] > 1e-2


_LOSE_A_TENSOR = """
import sys
from miles.refit.tensor_handles import ColocatedWeightUpdater as U
send = U._send_bucket
U._send_bucket = lambda self, bucket, *a, **k: send(self, bucket[1:], *a, **k)  # a refit that loses a tensor
from miles.tools.gpu_check.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_gpu_check_fails_when_a_refit_loses_a_tensor(tmp_path):
    out = tmp_path / "out.json"
    proc = _run(
        [sys.executable, "-c", _LOSE_A_TENSOR, "--device", "cpu", "--checks", "refit", "--json", str(out)]
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu-check: FAILED 2 of 2 checks: refit, generation" in proc.stdout
    res = _results(out)
    refit = res["refit"]["numbers"]
    assert refit["bit_equal"] == refit["tensors"] - 1
    assert res["generation"]["numbers"]["mean_abs_diff"] > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_says_why_it_cannot_run():
    proc = _run(["bash", "scripts/gpu-check.sh"], timeout=120)
    assert proc.returncode == 2 and "--device cuda but torch sees no CUDA device" in proc.stdout
    proc = _run(["bash", "scripts/gpu-check.sh", "--device", "cpu", "--checks", "train,nope"], timeout=120)
    assert proc.returncode == 2 and "--checks ['nope']: allowed" in proc.stderr
