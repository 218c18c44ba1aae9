"""The shipped launch scripts validate under --dry-run, and the CLI answers --help fast without heavy imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


# The reference miles recipe, flag for flag: radixark/miles scripts/run-qwen3-4B-fsdp.sh (commit 5699329422c9),
# its CKPT, ROLLOUT, GRPO, OPTIMIZER, SGLANG, TRAIN_BACKEND, PERF and MISC arrays (the wandb ones only when
# WANDB_API_KEY is set; the Ray start-up around it is not a flag). Switches map to [].
REFERENCE_RECIPE: dict[str, list[str]] = {
    "--hf-checkpoint": ["/root/Qwen3-4B"],
    "--load": ["/root/Qwen3-4B"],
    "--ref-load": ["/root/Qwen3-4B"],
    "--prompt-data": ["/root/dapo-math-17k/dapo-math-17k.jsonl"],
    "--input-key": ["prompt"],
    "--label-key": ["label"],
    "--apply-chat-template": [],
    "--rollout-shuffle": [],
    "--balance-data": [],
    "--rm-type": ["deepscaler"],
    "--num-rollout": ["100"],
    "--rollout-batch-size": ["8"],
    "--n-samples-per-prompt": ["8"],
    "--rollout-max-response-len": ["4096"],
    "--rollout-temperature": ["1"],
    "--global-batch-size": ["64"],
    "--use-kl-loss": [],
    "--advantage-estimator": ["grpo"],
    "--kl-loss-coef": ["0.00"],
    "--kl-loss-type": ["low_var_kl"],
    "--kl-coef": ["0.00"],
    "--entropy-coef": ["0.00"],
    "--eps-clip": ["0.2"],
    "--eps-clip-high": ["0.28"],
    "--optimizer": ["adam"],
    "--lr": ["1e-6"],
    "--lr-decay-style": ["constant"],
    "--weight-decay": ["0.1"],
    "--adam-beta1": ["0.9"],
    "--adam-beta2": ["0.98"],
    "--rollout-num-gpus-per-engine": ["1"],
    "--sglang-mem-fraction-static": ["0.75"],
    "--sglang-decode-log-interval": ["1000"],
    "--sglang-chunked-prefill-size": ["4096"],
    "--sglang-attention-backend": ["fa3"],
    "--train-backend": ["fsdp"],
    "--update-weight-buffer-size": ["536870912"],
    "--gradient-checkpointing": [],
    "--attn-implementation": ["flash_attention_3"],
    "--train-env-vars": ['{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}'],
    "--use-dynamic-batch-size": [],
    "--max-tokens-per-gpu": ["9216"],
    "--actor-num-nodes": ["1"],
    "--actor-num-gpus-per-node": ["8"],
    "--colocate": [],
    "--use-fault-tolerance": [],
    "--dump-details": ["/root/shared_data/qwen3-4B-fsdp-1116-noref/dump_details"],
}


def _script_argv(
    tmp_path: Path, wandb_key: str = "", script: str = "scripts/run-qwen3-4B-fsdp.sh"
) -> list[str]:
    """The exact argv `script` hands to `python3 -m miles.train` (a stand-in prints it)."""
    shim = tmp_path / "python3"
    shim.write_text('#!/bin/sh\nshift 2\nprintf "%s\\n" "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "WANDB_API_KEY": wandb_key, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """`--flag v1 v2 --switch` -> {"--flag": ["v1", "v2"], "--switch": []}; a flag given twice is refused."""
    flags: dict[str, list[str]] = {}
    current = None
    for token in argv:
        if token.startswith("--"):
            assert token not in flags, f"{token} given twice"
            flags[token] = []
            current = token
        else:
            assert current is not None, f"value {token!r} before any flag"
            flags[current].append(token)
    return flags


def test_qwen3_4b_script_is_the_reference_recipe(tmp_path):
    argv = _script_argv(tmp_path)
    assert _flags(argv) == REFERENCE_RECIPE
    # every flag parses, with the values the reference means
    from miles.config import parse_config

    cfg = yaml.safe_load(parse_config(argv).to_yaml())
    assert (
        cfg["cluster"]["rollout_num_gpus_per_engine"] == 1 and cfg["cluster"]["use_fault_tolerance"] is True
    )
    assert cfg["rollout"]["rollout_temperature"] == 1.0 and cfg["rollout"]["rollout_max_response_len"] == 4096
    assert cfg["engine"]["sglang_args"]["mem_fraction_static"] == "0.75"
    assert cfg["log"]["dump_details"] == REFERENCE_RECIPE["--dump-details"][0]
    assert cfg["checkpoint"]["load"] == cfg["model"]["hf_checkpoint"] and cfg["checkpoint"]["save"] is None
    # with a wandb key, only the wandb flags are added
    with_wandb = _flags(_script_argv(tmp_path, wandb_key="k"))
    assert set(with_wandb) - set(REFERENCE_RECIPE) == {"--use-wandb", "--wandb-project", "--wandb-group",
                                                       "--wandb-key"}  # fmt: skip


def test_qwen25_vl_3b_script_flags_parse(tmp_path):
    """The VL GPU recipe (issue 27): every flag parses (VL rules included: its SGLang engines are allowed), the
    Geo3K layout and the reference's values; --dry-run then refuses only the files this machine lacks."""
    from miles.config import parse_config
    from miles.config.vl_rules import parse_multimodal_keys

    script = "scripts/run-qwen2.5-vl-3b-fsdp.sh"
    argv = _script_argv(tmp_path, script=script)
    flags = _flags(argv)
    assert parse_multimodal_keys(flags["--multimodal-keys"][0]) == {"image": "images"}
    assert flags["--input-key"] == ["problem"] and flags["--label-key"] == ["answer"]
    assert flags["--hf-checkpoint"] == ["/root/Qwen2.5-VL-3B-Instruct"] and "--rollout-engine" not in flags
    cfg = yaml.safe_load(parse_config(argv).to_yaml())
    assert cfg["rollout"]["rollout_batch_size"] == 64 and cfg["rollout"]["rollout_max_response_len"] == 4096
    assert cfg["engine"]["sglang_args"]["mem_fraction_static"] == "0.6"
    proc = subprocess.run(["bash", script, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60)
    if not Path("/root/Qwen2.5-VL-3B-Instruct").is_dir():
        assert proc.returncode == 2 and "pre-flight check failed" in proc.stderr, proc.stderr
        assert "invalid configuration" not in proc.stderr
        assert "/root/Qwen2.5-VL-3B-Instruct" in proc.stderr.split("pre-flight check failed", 1)[1]


def test_qwen3_4b_script_passes_dry_run(tmp_path):
    # The flags validate; the pre-flight checks of --dry-run then refuse only what this machine lacks: the
    # model and the data file the script expects under /root.
    proc = subprocess.run(
        ["bash", "scripts/run-qwen3-4B-fsdp.sh", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if Path("/root/Qwen3-4B").is_dir() and Path("/root/dapo-math-17k").is_dir():
        assert proc.returncode == 0, proc.stderr
        assert (
            "holds no checkpoint" in proc.stderr and "starts from the --hf-checkpoint weights" in proc.stderr
        )
    else:
        assert proc.returncode == 2 and "pre-flight check failed" in proc.stderr, proc.stderr
        assert "invalid configuration" not in proc.stderr
        problems = proc.stderr.split("pre-flight check failed", 1)[1]
        for path in ("/root/Qwen3-4B", "/root/dapo-math-17k/dapo-math-17k.jsonl"):
            assert path in problems, path
        assert "--load" not in problems  # --load = --hf-checkpoint: named once, by --hf-checkpoint


def test_qwen3_4b_recipe_passes_dry_run_with_its_files_present(tmp_path):
    """The recipe's argv with /root/Qwen3-4B and the data replaced by a tiny model and data set: --dry-run
    passes, and says once that --load (the model directory, no checkpoint) starts from the HF weights."""
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    model = str(build_tiny_model(tmp_path / "Qwen3-4B", task="echo", seed=0))
    data = str(write_jsonl(make_rows("echo", 8, seed=0), tmp_path / "dapo-math-17k.jsonl"))
    argv = [
        model if a == "/root/Qwen3-4B" else data if a.endswith("dapo-math-17k.jsonl") else a
        for a in _script_argv(tmp_path)
    ]
    argv += ["--run-dir", str(tmp_path / "run"), "--dry-run"]
    # the recipe's --attn-implementation flash_attention_3 needs FlashAttention-3 where it runs (pre-flight looks
    # the module up, without importing it): an empty stand-in package plays the installed one
    site = tmp_path / "site"
    (site / "flash_attn_interface").mkdir(parents=True)
    (site / "flash_attn_interface" / "__init__.py").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "miles.train", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "flash_attn_interface" not in proc.stderr, proc.stderr
    assert proc.stderr.count("holds no checkpoint") == 1, proc.stderr
    assert f"--load={model!r} holds no checkpoint" in proc.stderr


def test_help_imports_nothing_heavy():
    """--help must stay fast: it answers before torch, ray or transformers are imported."""
    code = (
        "import sys, time; t = time.perf_counter(); from miles.train import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "--rollout-batch-size" in proc.stdout and "HEAVY []" in proc.stdout


def test_bad_flags_exit_2_with_every_violation(capsys):
    from miles.train import main

    assert main(["--hf-checkpoint", "/m", "--num-rollout", "0", "--lr", "-1", "--no-such-flag", "3"]) == 2
    err = capsys.readouterr().err
    for fragment in ("--num-rollout", "--lr", "--no-such-flag", "--prompt-data"):
        assert fragment in err, fragment


def test_qwen3_30b_a3b_script_flags_parse(tmp_path):
    """The MoE GPU recipe (issue 28): every flag parses with the MoE rules (R3, EP over the 8 training ranks);
    --dry-run then refuses only the files this machine lacks (the EP/checkpoint checks need its config.json)."""
    from miles.config import parse_config

    script = "scripts/run-qwen3-30B-A3B-fsdp.sh"
    argv = _script_argv(tmp_path, script=script)
    flags = _flags(argv)
    assert "--use-rollout-routing-replay" in flags and flags["--expert-model-parallel-size"] == ["8"]
    cfg = yaml.safe_load(parse_config(argv).to_yaml())
    assert cfg["rollout"]["use_rollout_routing_replay"] is True and cfg["cluster"]["colocate"] is True
    assert (
        cfg["cluster"]["actor_num_gpus_per_node"] == 8 and cfg["rollout"]["rollout_max_response_len"] == 8192
    )
    proc = subprocess.run(["bash", script, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60)
    if not Path("/root/Qwen3-30B-A3B").is_dir():
        assert proc.returncode == 2 and "pre-flight check failed" in proc.stderr, proc.stderr
        assert "invalid configuration" not in proc.stderr
        assert "/root/Qwen3-30B-A3B" in proc.stderr.split("pre-flight check failed", 1)[1]
