"""Config rules added for early errors (finite floats, engine access) and the file checks behind pre-flight.

The end-to-end view (every bad input through the real entry points) is tests/integration/test_bad_input_catalog.py.
"""

from __future__ import annotations

import struct

import pytest
import torch

from miles.config import ConfigError, parse_config
from miles.config.preflight import TRACKER_FILE, load_dir_problems
from miles.config.schema import FIELDS, FLOAT
from miles.config.validate import is_loopback_host
from miles.utils.hf_files import safetensors_problem

BASE = [
    "--hf-checkpoint",
    "/m",
    "--prompt-data",
    "/d.jsonl",
    "--num-rollout",
    "2",
    "--rollout-batch-size",
    "4",
    "--global-batch-size",
    "4",
    "--colocate",
]


def _violations(extra: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + extra)
    return e.value.violations


@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity", "nan"])
def test_every_float_flag_refuses_non_finite_values(value):
    floats = [spec.flag for spec in FIELDS.values() if spec.kind == FLOAT and spec.meta("cli", True)]
    assert "--lr" in floats and "--rollout-request-timeout" in floats
    for flag in floats:
        (problem,) = _violations([f"{flag}={value}"])
        assert problem.startswith(f"{flag}=") and ("finite" in problem or "NaN" in problem), problem


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback_host(host)
    assert parse_config(BASE + ["--engine-host", host]).engine.engine_host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "node-3.cluster"])
def test_public_engine_host_needs_a_key(host):
    assert not is_loopback_host(host)
    (problem,) = _violations(["--engine-host", host])
    assert problem.startswith(f"--engine-host={host!r}") and "--engine-api-key" in problem
    assert parse_config(BASE + ["--engine-host", host, "--engine-api-key", "k"]).engine.engine_host == host


def test_tracker_file_name_matches_the_checkpoint_module():
    from miles.backends.fsdp_utils import checkpoint

    assert TRACKER_FILE == checkpoint.TRACKER_FILE


def test_load_dir_rules(tmp_path, caplog):
    fresh = str(tmp_path / "new")
    with caplog.at_level("WARNING", logger="miles.config.preflight"):
        assert load_dir_problems(fresh, fresh) == []
    assert "does not exist yet; it is also --save: starting fresh" in caplog.text
    (tmp_path / "ckpt").mkdir()
    (problem,) = load_dir_problems(str(tmp_path / "ckpy"), None)
    assert "does not exist" in problem and "did you mean" in problem and "ckpt" in problem
    (problem,) = load_dir_problems(str(tmp_path / "ckpt"), str(tmp_path / "other"))
    assert f"holds no {TRACKER_FILE}" in problem
    assert load_dir_problems(str(tmp_path / "ckpt"), str(tmp_path / "ckpt")) == []
    (tmp_path / "ckpt" / TRACKER_FILE).write_text("3\n")
    (problem,) = load_dir_problems(str(tmp_path / "ckpt"), None)
    assert "names rollout 3" in problem and "iter_0000003" in problem
    for name in ("meta.pt", ".metadata"):
        (tmp_path / "ckpt" / "iter_0000003").mkdir(exist_ok=True)
        (tmp_path / "ckpt" / "iter_0000003" / name).write_bytes(b"x")
    assert load_dir_problems(str(tmp_path / "ckpt"), None) == []
    (problem,) = load_dir_problems(str(tmp_path / "ckpt" / "iter_0000003"), None)
    assert "pass" in problem and repr(str(tmp_path / "ckpt")) in problem


def test_safetensors_checks(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.ones(3, 4)}, str(path))
    assert safetensors_problem(path) is None
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-5])
    assert "is truncated" in safetensors_problem(tmp_path / "cut.safetensors")
    (tmp_path / "long.safetensors").write_bytes(data + b"xx")
    assert "is corrupt" in safetensors_problem(tmp_path / "long.safetensors")
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    assert "its header alone needs" in safetensors_problem(tmp_path / "head.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    assert "shorter than the 8-byte" in safetensors_problem(tmp_path / "tiny.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    assert "corrupt safetensors header" in safetensors_problem(tmp_path / "junk.safetensors")


def test_attention_kernel_modules_are_checked_where_the_driver_runs(monkeypatch):
    import importlib.util

    from miles.config import preflight

    installed: set[str] = set()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in installed else None)
    problems = preflight.attention_kernel_problems
    assert problems("sdpa", 2) == [] and problems("miles_varlen", 2) == []  # SDPA on CPU needs nothing
    (fa3,) = problems("flash_attention_3", 1)
    assert fa3.startswith("--attn-implementation flash_attention_3 needs the module flash_attn_interface")
    assert "hopper" in fa3
    fa2, ring = problems("flash_attention_2", 2)
    assert "module flash_attn," in fa2 and "miles[gpu]" in fa2
    assert "--context-parallel-size 2 needs the module ring_flash_attn" in ring and "--no-deps" in ring
    installed.update({"flash_attn", "flash_attn_interface"})
    assert problems("flash_attention_3", 1) == [] and problems("flash_attention_2", 1) == []
    assert len(problems("flash_attention_2", 2)) == 1
    installed.add("ring_flash_attn")
    assert problems("flash_attention_2", 2) == []
