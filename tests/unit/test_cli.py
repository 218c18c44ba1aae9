"""What a newcomer meets first: --dry-run output that --config reads back, --help naming the command that was run
and marking flags whose feature is not built."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import yaml

from miles.config import parse_config
from miles.train import config_yaml, main


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """Flags of a valid run whose files exist (the pre-flight checks run before --dry-run prints)."""
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("cli")
    model = build_tiny_model(root / "model", hidden_size=16, num_layers=1)
    data = write_jsonl(make_rows("echo", 8), root / "data.jsonl")
    return [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--rm-type", "math",
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--colocate", "--run-dir", str(root / "run"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # derived values (eps_clip_high, loss_reduction, rollout_num_gpus, lr_decay_iters), lists, dicts, sglang args
        ["--calculate-per-token-loss", "--eps-clip", "0.3", "--rollout-stop", "</s>", "END",
         "--train-env-vars", '{"NCCL_DEBUG": "INFO"}', "--sglang-mem-fraction-static", "0.7",
         "--sglang-enable-memory-saver", "--eval-interval", "2", "--save-hf", "/out/hf", "--use-tensorboard",
         "--no-progress"],
    ],
    ids=["defaults", "derived-lists-dicts-sglang"],
)  # fmt: skip
def test_dry_run_output_reads_back_as_config(tmp_path, capsys, base, extra):
    if "--eval-interval" in extra:
        extra = extra + ["--eval-prompt-data", "echo", base[base.index("--prompt-data") + 1]]
    assert main(base + extra + ["--dry-run"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    path = tmp_path / "run.yaml"
    path.write_text(printed)
    again = parse_config(["--config", str(path)])
    assert again == dataclasses.replace(parse_config(base + extra), config=str(path))
    assert "dry_run" not in yaml.safe_load(
        printed
    )  # feeding it back runs the job instead of dry-running again


def test_secrets_are_left_out_of_the_dry_run_yaml_and_named(tmp_path, base, monkeypatch):
    """--dry-run advises the environment or a 0600 --config file, never the command line (/proc/*/cmdline)."""
    monkeypatch.setenv("MILES_ENGINE_API_KEY", "s3cret")
    cfg = parse_config(base + ["--dry-run"])
    assert cfg.engine.engine_api_key == "s3cret"
    text = config_yaml(cfg)
    assert "s3cret" not in text and "engine_api_key" not in yaml.safe_load(text)["engine"]
    advice = text.rstrip().splitlines()[-1]
    assert advice.startswith(
        "# not shown: --engine-api-key (secrets: set --engine-api-key as $MILES_ENGINE_API_KEY"
    )
    assert "--config file only you can read (chmod 600)" in advice and "command line is readable" in advice
    path = tmp_path / "run.yaml"
    path.write_text(text)
    again = parse_config(["--config", str(path)])  # the key from the environment again
    assert again == dataclasses.replace(cfg, dry_run=False, config=str(path))


def test_secret_sources_merge_below_the_config_file_and_the_command_line(tmp_path, base, monkeypatch):
    monkeypatch.setenv("MILES_ENGINE_API_KEY", "from-env")
    monkeypatch.setenv("MILES_WANDB_KEY", "wandb-env")
    assert parse_config(base).log.wandb_key == "wandb-env"
    assert parse_config(base + ["--engine-api-key", "from-cli"]).engine.engine_api_key == "from-cli"
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  engine_api_key: from-file\n")
    path.chmod(0o600)
    assert parse_config(base + ["--config", str(path)]).engine.engine_api_key == "from-file"


def test_secrets_where_other_users_can_read_them_draw_a_warning(tmp_path, base, caplog):
    path = tmp_path / "run.yaml"
    path.write_text("engine_api_key: from-file\n")
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="miles.config.secrets"):
        parse_config(base + ["--config", str(path)])
    assert caplog.records == []
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="miles.config.secrets"):
        parse_config(base + ["--config", str(path)])
        parse_config(base + ["--engine-api-key", "on-the-cli"])
    file_warning, cli_warning = (r.getMessage() for r in caplog.records)
    assert f"--config {path} sets --engine-api-key and is readable by other users (mode 644)" in file_warning
    assert f"chmod 600 {path}" in file_warning
    assert cli_warning.startswith("--engine-api-key given on the command line: set --engine-api-key as ")
    assert "on-the-cli" not in file_warning + cli_warning


@pytest.mark.parametrize(
    "module, argv0, expected",
    [("miles.train", "miles-train", "usage: miles-train "),
     ("miles.train_async", "miles-train-async", "usage: miles-train-async ")],
)  # fmt: skip
def test_console_script_help_names_itself(monkeypatch, capsys, module, argv0, expected):
    import importlib

    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{argv0}", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).cli()
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(expected)


def test_module_help_names_python_m(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m miles.train ")


def test_help_marks_flags_that_are_not_built(capsys, monkeypatch):
    from types import MappingProxyType

    from miles.config import FIELDS, NOT_IMPLEMENTED

    unbuilt = set(NOT_IMPLEMENTED) or {"use_fault_tolerance"}  # nothing unbuilt today: mark one for the test
    for name in unbuilt:
        field = FIELDS[name].field
        monkeypatch.setattr(field, "metadata", MappingProxyType({**field.metadata, "implemented": False}))
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    for name in unbuilt:
        flag = "--" + name.replace("_", "-")
        # "--use-fault-tolerance, --no-use-fault-tolerance [NOT BUILT: ...", or "--some-flag STR [NOT BUILT: ..."
        start = re.search(re.escape(flag) + "[ ,]", out).start()
        assert "[NOT BUILT: refused when set]" in out[start : start + 120], out[start : start + 120]
    assert out.count("[NOT BUILT") == len(unbuilt)


def test_ref_load_accepts_a_dcp_checkpoint_before_ray(tmp_path, capsys, base):
    root = tmp_path / "ckpt"
    (root / "iter_0000004").mkdir(parents=True)
    (root / "iter_0000004" / ".metadata").write_bytes(b"")
    (root / "latest_checkpointed_iteration.txt").write_text("4\n")
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.1", "--dry-run"]
    for ref in (root, root / "iter_0000004"):  # a --save directory, or one checkpoint of it
        assert main(base + kl + ["--ref-load", str(ref)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(base + kl + ["--ref-load", str(tmp_path / "nothing")]) == 2
    assert "--ref-load" in capsys.readouterr().err


def test_ctrl_c_shuts_down_and_still_draws_the_report(monkeypatch, tmp_path, base, capsys):
    pytest.importorskip("matplotlib")
    import miles.ray.setup as setup
    from miles.train import run_driver
    from miles.utils.timer import Timer
    from miles.utils.tracking import Tracker

    events = []

    class FakeSystem:
        timer = Timer()

        def shutdown(self, fast: bool = False) -> None:
            events.append(("shutdown", fast))

    def loop(cfg, system) -> None:
        tracker = Tracker(cfg.log.run_dir)
        for step in range(3):
            tracker.log(step, {"rollout/raw_reward": 0.1 * step, "timing/rollout": 1.0})
        tracker.close()
        with system.timer.phase("train"):
            raise KeyboardInterrupt

    monkeypatch.setattr(setup, "build_system", lambda cfg: FakeSystem())
    run_dir = tmp_path / "interrupted"
    assert run_driver(base + ["--run-dir", str(run_dir)], loop, prog="miles-train") == 130
    assert events == [("shutdown", True)]  # engines killed, not drained
    assert "miles-train: interrupted (Ctrl-C) in phase 'train'" in capsys.readouterr().err
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_no_prompt_fitting_max_prompt_len_fails_before_ray(capsys, base):
    """The doctor's prompt count runs in the driver's pre-flight: --dry-run exits 2 naming the file and the flag."""
    assert main(base + ["--rollout-max-prompt-len", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "pre-flight check failed" in err and "0 of all 8 prompts fit --rollout-max-prompt-len=1" in err
    assert main(base + ["--rollout-max-prompt-len", "64", "--dry-run"]) == 0, capsys.readouterr().err
