"""`python -m miles.tools.doctor` in a fresh interpreter on a tiny model, with the machine's real probes (versions,
nvidia-smi, Ray, disk, the model's own tokenizer and chat template): one run whose only blocker is that no prompt
fits --rollout-max-prompt-len."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_doctor_prints_the_table_and_exits_1_on_a_blocker(tmp_path: Path) -> None:
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    model = build_tiny_model(tmp_path / "model", hidden_size=16, num_layers=1)
    data = write_jsonl(make_rows("echo", 8), tmp_path / "data.jsonl")
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "4",
        "--global-batch-size", "4", "--colocate", "--rollout-max-prompt-len", "4", "--save", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, "-m", "miles.tools.doctor", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line and not line.startswith(" ")}
    for check in (
        "python",
        "torch",
        "transformers",
        "sglang",
        "GPUs",
        "model",
        "memory",
        "disk",
        "pre-flight",
    ):
        assert check in rows, out.stdout
    assert (
        "0 of all 8 prompts fit --rollout-max-prompt-len=4" in rows["prompt"] and "BLOCKER" in rows["prompt"]
    )
    assert "OK" in rows["model"] and "qwen3" in rows["model"] and "OK" in rows["disk"]
    assert "1 blocker(s)" in out.stdout
