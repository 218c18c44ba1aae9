"""Eval through the rollout runner (fake engine): pass@k against a brute-force reference, eval flags, dumps."""

from __future__ import annotations

import itertools
import json
import re
import statistics

import pytest

from miles.config import parse_config
from miles.rollout.metrics import pass_at_k
from miles.rollout.runner import RolloutRunner
from tests.fake_engine import FakeEngine, Reply


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c correct) that contain a correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(n, 0, n + 1)


@pytest.fixture(scope="module")
def tokenizer():
    from miles.tools.tiny_model import build_tokenizer

    return build_tokenizer("echo")


def test_eval_metrics_flags_and_dump(tokenizer, tmp_path):
    from miles.tools.toy_data import write_jsonl

    # 3 eval prompts under other keys; prompt g gets g correct answers out of 4 (sample j correct when j < g)
    rows = [{"question": f"echo {d} {d} {d} {d}", "answer": str(d)} for d in (1, 2, 3)]
    write_jsonl(rows, tmp_path / "ev.jsonl")
    write_jsonl([{"prompt": "echo 1 1 1 1", "label": "1"}], tmp_path / "train.jsonl")

    def respond(ids, sp, rid):
        m = re.match(r"eval-toy--1-(\d+)$", rid)
        assert m, rid
        i = int(m.group(1))
        g, j = divmod(i, 4)
        digit = ids[-1] - 4
        text = str(digit) if j < g else "0"
        return Reply([4 + int(text)] * (1 + j), text=text, finish="length" if j == 3 else "stop")

    engine = FakeEngine(respond)
    cfg = parse_config(
        (
            f"--hf-checkpoint /m --prompt-data {tmp_path}/train.jsonl --input-key prompt --label-key label "
            "--num-rollout 2 --rollout-batch-size 1 --global-batch-size 1 --colocate --rm-type math "
            f"--eval-prompt-data toy {tmp_path}/ev.jsonl --eval-input-key question --eval-label-key answer "
            "--n-samples-per-eval-prompt 4 --eval-interval 1 --eval-top-p 0.5 --eval-top-k 3 --eval-temperature 0.7 "
            "--eval-max-response-len 9"
        ).split()
    )
    runner = RolloutRunner(cfg.data, cfg.rollout, cfg.eval, tokenizer, engine.url, [engine.url], None, 16,
                           dump_dir=str(tmp_path / "dump"), transport=engine.transport)  # fmt: skip
    metrics = runner.evaluate(-1)
    sp = engine.requests[0]["sampling_params"]
    assert (sp["top_p"], sp["top_k"], sp["temperature"], sp["max_new_tokens"]) == (0.5, 3, 0.7, 9)
    correct = [0, 1, 2]
    for k in range(1, 5):
        expected = statistics.fmean(brute_force_pass_at_k(4, c, k) for c in correct)
        assert metrics[f"eval/toy/pass@{k}"] == pytest.approx(expected)
    assert metrics["eval/toy"] == pytest.approx(sum(correct) / 12)
    assert (
        metrics["eval/toy/response_len"] == pytest.approx(2.5) and metrics["eval/toy/response_len_max"] == 4
    )
    assert metrics["eval/toy/truncated_frac"] == 0.25
    lines = (tmp_path / "dump" / "eval_toy_before_train.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["label"] == "1"
