"""Config rules added for early errors (finite floats, engine access) and the file checks behind pre-flight.

The end-to-end view (every bad input through the real entry points) is tests/integration/test_bad_input_catalog.py.
"""

from __future__ import annotations

import struct

import pytest
import torch

from miles.config import ConfigError, parse_config
from miles.config.schema import FIELDS, FLOAT
from miles.config.validate import is_loopback_host
from miles.preflight.checks import TRACKER_FILE, load_dir_problems
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


def test_multi_node_run_refuses_a_loopback_engine_host():
    two_nodes = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4"]
    (problem,) = _violations(two_nodes)  # the default --engine-host 127.0.0.1
    assert problem.startswith(
        "--engine-host='127.0.0.1' [default]: is a loopback address, but --actor-num-nodes=2"
    )
    assert "--engine-host 0.0.0.0" in problem and "--engine-api-key" in problem
    (problem,) = _violations(two_nodes + ["--engine-host", "localhost"])
    assert problem.startswith("--engine-host='localhost': is a loopback address")
    cfg = parse_config(BASE + two_nodes + ["--engine-host", "0.0.0.0", "--engine-api-key", "k"])
    assert cfg.cluster.actor_num_nodes == 2 and cfg.engine.engine_host == "0.0.0.0"
    assert parse_config(BASE).engine.engine_host == "127.0.0.1"  # one node: loopback is right


def test_engines_placed_on_several_machines_refuse_a_loopback_engine_host(monkeypatch):
    """Ray may put engines on another machine than the trainers with --actor-num-nodes 1; start-up refuses a
    loopback --engine-host then (simulated nodes of one machine share its address and pass)."""
    import ray

    from miles.config.validate import loopback_engine_host_problem
    from miles.ray import setup

    assert loopback_engine_host_problem("127.0.0.1", {"10.0.0.1"}) is None
    assert loopback_engine_host_problem("0.0.0.0", {"10.0.0.1", "10.0.0.2"}) is None
    problem = loopback_engine_host_problem("127.0.0.1", {"10.0.0.2", "10.0.0.1"})
    assert problem is not None and "on 2 machines (10.0.0.1, 10.0.0.2)" in problem and "0.0.0.0" in problem

    nodes = [{"NodeID": "a", "NodeManagerAddress": "10.0.0.1"}, {"NodeID": "b", "NodeManagerAddress": "10.0.0.2"},
             {"NodeID": "c", "NodeManagerAddress": "10.0.0.1"}]  # fmt: skip
    table = {"bundles_to_node_id": {0: "a", 1: "c"}}
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: table)
    placement = setup.Placement(None, True, [0], [1], colocate=False)  # type: ignore[arg-type]
    setup.check_engine_host_reachable("127.0.0.1", placement)  # two nodes, one machine
    table["bundles_to_node_id"][1] = "b"
    with pytest.raises(ValueError, match=r"--engine-host='127.0.0.1' is a loopback address.*2 machines"):
        setup.check_engine_host_reachable("127.0.0.1", placement)
    setup.check_engine_host_reachable("0.0.0.0", placement)


def test_tracker_file_name_matches_the_checkpoint_module():
    from miles.backends.fsdp_utils import checkpoint

    assert TRACKER_FILE == checkpoint.TRACKER_FILE


def test_load_dir_rules(tmp_path, caplog):
    fresh = str(tmp_path / "new")
    with caplog.at_level("WARNING", logger="miles.preflight.checks"):
        assert load_dir_problems(fresh, fresh, "/m") == []
    assert (
        "does not exist yet; it is also --save: the run starts from the --hf-checkpoint weights"
        in caplog.text
    )
    (tmp_path / "ckpt").mkdir()
    (problem,) = load_dir_problems(str(tmp_path / "ckpy"), None)
    assert "does not exist" in problem and "did you mean" in problem and "ckpt" in problem
    (problem,) = load_dir_problems(str(tmp_path / "nowhere"), str(tmp_path / "other"))
    assert problem.startswith(f"--load={str(tmp_path / 'nowhere')!r}: directory does not exist"), problem
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
    (tmp_path / "ckpt" / TRACKER_FILE).unlink()  # checkpoints whose tracker is gone: not a fresh start
    (problem,) = load_dir_problems(str(tmp_path / "ckpt"), None)
    assert "holds checkpoints (iter_0000003)" in problem and TRACKER_FILE in problem
    assert (
        load_dir_problems(str(tmp_path / "gone"), None, str(tmp_path / "gone")) == []
    )  # named by --hf-checkpoint
    (tmp_path / "file").write_text("x")
    (problem,) = load_dir_problems(str(tmp_path / "file"), None)
    assert "is a file" in problem


def test_load_of_a_directory_without_checkpoint_starts_from_hf(tmp_path, caplog):
    """The reference's `--load /root/Qwen3-4B` (the HF directory, no --save): the run starts from the HF weights
    and one log line says so; the same directory with a checkpoint in it resumes."""
    hf = tmp_path / "Qwen3-4B"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with caplog.at_level("INFO", logger="miles.preflight.checks"):
        assert load_dir_problems(str(hf), None, str(hf)) == []
        assert load_dir_problems(str(hf), str(tmp_path / "elsewhere"), str(hf)) == []
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"--load={str(hf)!r} holds no checkpoint (no {TRACKER_FILE}): the run starts from the "
                     f"--hf-checkpoint weights ({str(hf)!r})"] * 2  # fmt: skip


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


def test_replay_data_is_checked_in_full_unless_load_resumes_a_checkpoint(tmp_path):
    """--load of a directory without a checkpoint starts at rollout 0, so every saved rollout must be there;
    resuming a checkpoint needs only the last one."""
    from miles.preflight.checks import _debug_data_problems, _has_checkpoint

    data = str(tmp_path / "r_{rollout_id}.jsonl")
    (tmp_path / "r_2.jsonl").write_text("")
    hf = tmp_path / "hf"
    hf.mkdir()
    assert not _has_checkpoint(str(hf)) and not _has_checkpoint(None)
    (problem,) = _debug_data_problems(data, 3, resuming=_has_checkpoint(str(hf)))
    assert "2 of the 3 rollouts are missing" in problem
    (hf / TRACKER_FILE).write_text("1\n")
    assert _has_checkpoint(str(hf)) and _debug_data_problems(data, 3, resuming=True) == []


def test_attention_kernel_modules_are_checked_where_the_driver_runs(monkeypatch):
    import importlib.util

    from miles.preflight import checks as preflight

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


def test_an_agent_returning_rewards_needs_no_reward_function():
    from miles.preflight.checks import reward_problems

    assert "no reward function" in reward_problems(None, None, None)[0]
    assert reward_problems(None, None, None, agent="examples.openai_agent.agent:run") == []
    assert "unknown reward type" in reward_problems("nope", None, None, agent="m:run")[0]
