"""miles' GRPO gradient equals TRL's GRPOTrainer gradient on one identical batch (scripts/bench/grad_vs_trl.py).

Both real trainers take one optimizer step on the same model, prompts, responses (some ending at EOS, lengths
spread) and math rewards: miles' `FSDPTrainer.train` on a gloo rank, TRL 1.16's `GRPOTrainer.train` with its
generation replaced by the fixed responses, each configured by the benchmark's own settings
(`vs_trl.miles_command`, `trl_child.grpo_config_kwargs`). They must train on the same token ids, score the same
rewards, and compute the same gradient for every tensor. The one known difference: the std epsilon of the group
advantage (miles 1e-6, TRL 1e-4), which scales each rewarded group's advantages (and so the gradient) by
(std + 1e-4) / (std + 1e-6), about 1.0003 for one success in eight.

Needs TRL's venv (`bash scripts/trl-venv.sh` makes it at .venv-trl; `MILES_TRL_VENV` points elsewhere); without it
this skips (fails under CI=true, tests/conftest.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import grad_vs_trl  # noqa: E402
from bench_workloads import get_workload  # noqa: E402

TRL_VENV = Path(os.environ.get("MILES_TRL_VENV", ROOT / ".venv-trl"))

pytestmark = pytest.mark.side_venv(TRL_VENV, ".miles-bench-stamp", "bash scripts/trl-venv.sh")


def test_grpo_gradient_equals_trl_on_identical_batch(tmp_path: Path) -> None:
    w = get_workload("varlen").quick()  # small model, responses up to 32 tokens, 16 prompts x 8 samples
    c, text = grad_vs_trl.run(w, tmp_path, TRL_VENV, miles_ranks=1, seed=0)
    print(text)
    assert c.same_tokens and c.same_response_lengths, "the two trainers trained on different token ids"
    assert c.max_reward_diff == 0.0
    assert 0.0 < c.max_advantage_diff < 2e-3  # the std epsilon only (module docstring)
    assert c.miles_grad_norm > 0.0, "no rewarded group in the batch: the comparison would be vacuous"
    assert c.global_grad_cosine > 0.99999
    assert c.min_grad_cosine > 0.9999, [(t.name, t.grad_cosine) for t in c.tensors if t.grad_cosine <= 0.9999]
    assert c.miles_grad_norm / c.trl_grad_norm == pytest.approx(1.0, abs=2e-3)
    for t in c.tensors:
        assert t.delta_cosine > 0.999, f"{t.name}: optimizer steps differ (cosine {t.delta_cosine})"
