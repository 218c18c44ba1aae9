"""`miles.refit.delta`: which tensors a delta refit sends, to which engines everything goes, and the flag's rules."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError, parse_config
from miles.refit import delta as delta_mod
from miles.refit.delta import DeltaTracker, fingerprint, probe_bases

A, B = "http://e0:1", "http://e1:2"


def _bucket(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    return [
        ("embed", torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale),
        ("norm", torch.ones(3, dtype=torch.bfloat16)),
    ]


def _refit(tracker: DeltaTracker, bases: dict[str, str | None], version: str, bucket) -> list[str]:
    tracker.begin(bases, version)
    sent = [name for name, _ in tracker.select(bucket)]
    tracker.acknowledge(version)
    return sent


def test_fingerprint_sees_bytes_dtype_and_shape():
    t = torch.arange(6, dtype=torch.float32)
    assert fingerprint(t) == fingerprint(t.clone())
    changed = t.clone()
    changed[3] = torch.nextafter(changed[3], torch.tensor(10.0))  # one ulp
    assert fingerprint(changed) != fingerprint(t)
    assert fingerprint(t.reshape(2, 3)) != fingerprint(t)
    assert fingerprint(t.view(torch.int32)) != fingerprint(t)
    assert fingerprint(t.reshape(2, 3).t()) == fingerprint(t.reshape(2, 3).t().contiguous())


def test_changed_sends_only_what_some_engine_lacks_and_counts_it():
    tracker = DeltaTracker("changed")
    assert _refit(tracker, {A: "default", B: "default"}, "1", _bucket()) == ["embed", "norm"]  # nothing acked
    assert tracker.stats.full_engines == 2
    assert _refit(tracker, {A: "1", B: "1"}, "2", _bucket(2.0)) == ["embed"]
    s = tracker.stats
    assert (s.tensors_sent, s.tensors_total, s.bytes_sent, s.bytes_total) == (1, 2, 24, 30)
    assert s.metrics()["perf/refit_bytes"] == 24.0 and s.metrics()["perf/refit_tensors_sent"] == 1.0
    assert _refit(tracker, {A: "2", B: "2"}, "3", _bucket(2.0)) == []
    assert tracker.stats.full_engines == 0


def test_restarted_failed_or_mismatched_engines_get_everything():
    tracker = DeltaTracker("changed")
    _refit(tracker, {A: None, B: None}, "1", _bucket())
    tracker.forget([B])  # restarted
    assert _refit(tracker, {A: "1", B: "default"}, "2", _bucket()) == ["embed", "norm"]
    assert _refit(tracker, {A: "2", B: "2"}, "3", _bucket()) == []
    # A declares another intact version than it acknowledged (resumed memory, reloaded from disk)
    assert _refit(tracker, {A: None, B: "3"}, "4", _bucket()) == ["embed", "norm"]
    assert _refit(tracker, {A: "7", B: "4"}, "5", _bucket()) == ["embed", "norm"]
    # a refit that failed is not acknowledged: the caller forgets its targets
    tracker.begin({A: "5", B: "5"}, "6")
    assert [name for name, _ in tracker.select(_bucket(3.0))] == ["embed"]
    tracker.forget([A, B])
    assert _refit(tracker, {A: "6", B: "6"}, "7", _bucket(3.0)) == ["embed", "norm"]


def test_none_sends_everything_without_hashing(monkeypatch):
    monkeypatch.setattr(delta_mod, "fingerprint", lambda t: pytest.fail("hashed in mode none"))
    tracker = DeltaTracker("none")
    for v in ("1", "2"):
        assert _refit(tracker, {A: v, B: v}, v, _bucket()) == ["embed", "norm"]
    assert tracker.stats.bytes_sent == tracker.stats.bytes_total == 30


def test_bad_mode_names_the_flag():
    with pytest.raises(ValueError, match=r"--update-weight-delta 'xor': allowed \['none', 'changed'\]"):
        DeltaTracker("xor")


def test_probe_takes_the_miles_field_and_treats_sglang_as_full(monkeypatch, caplog):
    answers = {A: {"weight_version": "3", "refit_delta_version": "3"}, B: {"weight_version": "3"}}
    monkeypatch.setattr(delta_mod, "get_engine_json", lambda url, endpoint, *a: answers[url])
    with caplog.at_level("INFO", logger="miles.refit.delta"):
        assert probe_bases([A, B], {}, 5.0, "4") == {A: "3", B: None}
    assert f"engine {B} gets a full refit" in caplog.text and "SGLang has no delta protocol" in caplog.text


BASE = [
    "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2", "--global-batch-size", "4",
]  # fmt: skip


def test_update_weight_delta_rules():
    assert parse_config([*BASE, "--colocate"]).train.update_weight_delta == "none"
    disagg = [*BASE, "--rollout-num-gpus", "1", "--engine-host", "0.0.0.0", "--engine-api-key", "k"]
    assert parse_config([*disagg, "--update-weight-delta", "changed"]).train.update_weight_delta == "changed"
    with pytest.raises(ConfigError, match="update-weight-delta.*--colocate"):
        parse_config([*BASE, "--colocate", "--update-weight-delta", "changed"])
    with pytest.raises(ConfigError, match="update-weight-delta.*transfer-mode tensor"):
        parse_config([*disagg, "--update-weight-transfer-mode", "tensor", "--update-weight-delta", "changed"])
    with pytest.raises(ConfigError, match="update-weight-delta"):
        parse_config([*disagg, "--update-weight-delta", "xor"])
