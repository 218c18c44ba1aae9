"""Saved rollouts for replay debugging: exact round trip, paths, atomic writes, clear errors; the flag rules."""

from __future__ import annotations

import json
import math

import pytest

from miles.utils.debug_data import load_rollout, missing_rollouts, rollout_path, save_rollout
from miles.utils.types import Sample, SampleStatus

FLAG = "--load-debug-rollout-data"


def _samples() -> list[Sample]:
    a = Sample(index=0, group_index=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 0],
               rollout_log_probs=[-0.1234567891234, 0.0], reward={"acc": 1.0, "fmt": 0.1},
               status=SampleStatus.COMPLETED, metadata={"tool_calls": 1})  # fmt: skip
    b = Sample(index=1, group_index=0, tokens=[5, 6, 9], response_length=1, loss_mask=[1],
               rollout_log_probs=[-1e-300], reward=0.1 + 0.2, status=SampleStatus.TRUNCATED)  # fmt: skip
    return [a, b]


@pytest.mark.parametrize("template", [True, False])
def test_round_trip_is_exact(tmp_path, template):
    path = str(tmp_path / "r_{rollout_id}.jsonl") if template else str(tmp_path / "dir")
    samples, metrics = _samples(), {"rollout/raw_reward": 0.30000000000000004, "rollout/x": float("nan")}
    file = save_rollout(path, 3, samples, metrics, "--save-debug-rollout-data")
    assert file == rollout_path(path, 3) and file.name == (
        "r_3.jsonl" if template else "rollout_0000003.jsonl"
    )
    assert [p.name for p in file.parent.iterdir()] == [file.name]  # no temp file left
    back, back_metrics = load_rollout(path, 3, FLAG)
    assert back == samples  # floats, dict rewards, statuses and metadata exactly
    assert back_metrics["rollout/raw_reward"] == 0.30000000000000004 and math.isnan(back_metrics["rollout/x"])
    assert missing_rollouts(path, range(2, 5)) == [rollout_path(path, 2), rollout_path(path, 4)]


def test_bad_files_name_file_and_line(tmp_path):
    path = str(tmp_path / "r_{rollout_id}.jsonl")
    with pytest.raises(ValueError, match=r"r_0.jsonl does not exist"):
        load_rollout(path, 0, FLAG)
    file = save_rollout(path, 0, _samples(), {}, "--save-debug-rollout-data")
    lines = file.read_text().splitlines()
    file.write_text("\n".join(lines[:2]) + "\n")  # truncated: one sample of two
    with pytest.raises(ValueError, match=r"header says 2 samples, found 1"):
        load_rollout(path, 0, FLAG)
    file.write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"r_0.jsonl:2: not a sample"):
        load_rollout(path, 0, FLAG)
    header = json.loads(lines[0])
    file.write_text(json.dumps({**header, "rollout_id": 5}) + "\n")
    with pytest.raises(ValueError, match=r"r_0.jsonl:1: expected a .* header of rollout 0"):
        load_rollout(path, 0, FLAG)


def test_unserialisable_sample_names_the_flag_and_leaves_nothing(tmp_path):
    s = _samples()[0]
    s.metadata = {"obj": object()}
    with pytest.raises(ValueError, match=r"--save-debug-rollout-data=.*sample 0 of rollout 1 is not JSON"):
        save_rollout(str(tmp_path / "d"), 1, [s], {}, "--save-debug-rollout-data")
    assert list((tmp_path / "d").iterdir()) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--debug-train-only"], "--debug-train-only.*requires --load-debug-rollout-data"),
        (
            ["--load-debug-rollout-data", "d", "--debug-rollout-only"],
            "conflicts with --load-debug-rollout-data",
        ),
        (["--load-debug-rollout-data", "d", "--save-debug-rollout-data", "e"], "nothing is generated"),
        (["--debug-rollout-only", "--save", "ckpt"], "nothing to save with --debug-rollout-only"),
    ],
)
def test_flag_rules(flags, message):
    from miles.config import ConfigError, parse_config

    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl"]
    with pytest.raises(ConfigError, match=message):
        parse_config(base + flags)
