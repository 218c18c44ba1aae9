"""Reproducible runs and exact resume on CPU: N rollouts straight vs N/2, `--load`, N/2 more.

One trainer and one embedded engine (colocated on one bundle), a tiny model, N = 4 rollouts of 2 prompts x 4
samples with shuffled data: the resumed run ends with bit-equal weights (every tensor of the final HF export) and
the same metrics lines as the straight one (timing, throughput and memory keys aside; the metrics made from
the engine's log-probs within 1e-6, see ENGINE_LOGPROB_KEYS). The first half of the resumed run is itself a
second run of the same flags, so this also checks run-to-run reproducibility of rewards, losses and trainer
log-probs (the engine seeds each request from --rollout-seed and the request id).
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow

N = 4
VOLATILE = ("timing/", "perf/")  # wall-clock and memory measurements: differ from run to run by nature
# The embedded engine's batched decode is not batch-invariant (an fp32 matmul row depends on how many rows the
# batch has: the same request's log-probs differ by ~2e-7 alone vs in a batch of 16), and which requests share a
# decode step depends on arrival times. So the engine's log-probs, and metrics made from them, may differ in the
# last bits between runs; the tokens drawn, and so rewards, losses and weights, do not.
# train/ois is the mean of exp(old - rollout log-prob): made from the engine's log-probs too (the run uses no TIS/MIS,
# so they do not enter the loss)
ENGINE_LOGPROB_KEYS = ("train/train_rollout_logprob_abs_diff", "train/ois")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("resume")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    data = write_jsonl(make_rows("echo", 64, seed=0), root / "data.jsonl")
    return root, str(model), str(data)


def _args(model: str, data: str, run_dir: str, num_rollout: int, extra: list[str] = ()) -> list[str]:
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", str(num_rollout),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
        "--rollout-temperature", "1.0", "--global-batch-size", "8", "--lr", "1e-2",
        "--actor-num-gpus-per-node", "1", "--colocate", "--run-dir", run_dir,
        "--save", os.path.join(run_dir, "ckpt"), "--save-interval", "2", "--save-hf", os.path.join(run_dir, "hf"), *extra,
    ]  # fmt: skip


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _split(row: dict) -> tuple[dict, dict]:
    exact = {k: v for k, v in row.items() if k not in ENGINE_LOGPROB_KEYS}
    return exact, {k: v for k, v in row.items() if k in ENGINE_LOGPROB_KEYS}


def _final_weights(run_dir: str) -> dict:
    from safetensors.torch import load_file

    final = os.path.join(run_dir, "hf", f"iter_{N - 1:07d}")  # named by the last rollout id
    tensors = {}
    for name in sorted(os.listdir(final)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(final, name)))
    assert tensors, os.listdir(final)
    return tensors


def test_n_straight_equals_half_resume_half(tiny, capfd):
    import torch

    from miles.train import main

    root, model, data = tiny
    straight, resumed = str(root / "straight"), str(root / "resumed")
    assert main(_args(model, data, straight, N)) == 0
    assert main(_args(model, data, resumed, N // 2)) == 0
    assert main(_args(model, data, resumed, N, ["--load", os.path.join(resumed, "ckpt")])) == 0
    assert f"at rollout {N // 2}" in capfd.readouterr().out  # the driver says what it resumed from

    a, b = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(N))
    for step, (row_a, row_b) in enumerate(zip(a, b)):
        (ra, la), (rb, lb) = _split(row_a), _split(row_b)
        assert ra == rb, (
            step,
            {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)},
        )
        assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) <= 1e-6 for k in la), (step, la, lb)
    assert any(r["train/grad_norm"] > 0 for r in a)  # the weights did move: the comparison is not vacuous

    wa, wb = _final_weights(straight), _final_weights(resumed)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, different
