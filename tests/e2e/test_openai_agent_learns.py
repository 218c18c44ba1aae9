"""The calculator agent of examples/openai_agent (the official `openai` SDK, unmodified) trained on the tiny
calculator model through `--use-session-server`: the model's Qwen3-style template offers the tool, the agent
returns shaped rewards (no reward function configured), every rollout completes, the reward rises by 0.3 and
the trainer's log-probs equal the engine's on every trained token.

Sized for the 3-minute e2e budget: 8 rollouts of 8 prompts x 8 sessions, lr 1.5e-2, a 32-token response budget
per session (it counts the tool answer and template glue too: about 24 tokens between the call and the next
turn), and `<tool_call>` as a stop token: the tiny model cannot write a call's JSON (the agent takes a bare
`<tool_call>` as a call of the question's expression), and a call turn that rambled on to the end of the
budget would leave none for the answer. Without the stop token (16, 20 or 32-token budgets, 5e-3 to 3e-2) the
reward levels off at 0.4 (every session calls; no answer fits), a gain of about 0.26.
Measured (2 shared CPU cores, seed 1): raw reward 0.145, 0.183, 0.316, 0.370, 0.427, 0.409, 0.483, 0.509
(89 s for the training run alone, 154 s for the test under a load average of 9-14; log-prob diff <= 3e-7); lr 1e-2 reached 0.461, lr 3e-2 0.466 then fell to 0.15.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 8


def call_token_id(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<tool_call>")


def test_openai_sdk_agent_learns_through_the_session_server(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    art, run = tmp_path / "art", tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "examples.openai_agent.build", "--out", str(art)],
        cwd=REPO,
        env=env,
        check=True,
    )
    cmd = [
        sys.executable, "-m", "miles.train",
        "--hf-checkpoint", str(art / "model"), "--prompt-data", str(art / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
        "--use-session-server", "--agent-function-path", "examples.openai_agent.agent:run",
        "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "32", "--rollout-temperature", "1.0",
        "--rollout-stop-token-ids", str(call_token_id(art / "model")),
        "--global-batch-size", "64", "--micro-batch-size", "32",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1.5e-2", "--clip-grad", "1.0",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate",
        "--update-weight-buffer-size", "1048576", "--run-dir", str(run), "--seed", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == NUM_ROLLOUT
    rewards = [r["rollout/raw_reward"] for r in rows]
    assert all(0.0 <= x <= 1.0 for x in rewards), rewards
    print("raw reward per rollout:", [round(x, 3) for x in rewards])
    # the agent learns to call its tool and use its answer (shaped reward): the last two rollouts beat the
    # untrained policy (rollout 0 is generated before the first step) by 0.3
    assert sum(rewards[-2:]) / 2 - rewards[0] >= 0.3, rewards
    # every trained token was sampled by the engine: the trainer's packed log-probs equal the engine's
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in rows) <= 1e-5
