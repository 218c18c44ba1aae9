"""`miles doctor` (miles/tools/doctor.py): every blocker and warning driven through `doctor_rows` with fake probes
(no GPU, no Ray, no subprocess), the prompt-length count shared with miles.train, and the table and exit code."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from miles.config import parse_config
from miles.tools import doctor
from miles.tools.doctor import BLOCKER, OK, WARN, Gpu, Probes, RayView, Row

GiB = 2**30


class WordTokenizer:
    """One token per whitespace-separated word; the chat template joins the messages' contents."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(range(len(text.split())))}

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        return " ".join(["<user>"] + [m["content"] for m in messages] + ["<assistant>"])


def write_model(root: Path, shape: tuple[int, int] = (1000, 10)) -> Path:
    """A model directory that passes the pre-flight checks: config, tokenizer file, one complete F32 tensor."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "toy", "torch_dtype": "float32"}))
    (root / "tokenizer.json").write_text("{}")
    nbytes = shape[0] * shape[1] * 4
    header = json.dumps({"w": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, nbytes]}}).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
    return root


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"input": p, "label": "x"}) + "\n" for p in prompts))
    return path


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Path]:
    return {
        "model": write_model(tmp_path / "model"),
        "data": write_prompts(tmp_path / "d.jsonl", ["a b c", "a b c d e f g h", "one"]),
        "save": tmp_path / "ckpt",
    }


def cfg_for(setup: dict[str, Path], *extra: str):
    return parse_config(
        ["--hf-checkpoint", str(setup["model"]), "--prompt-data", str(setup["data"]), "--label-key", "label"]
        + ["--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "4", "--global-batch-size", "4"]
        + ["--colocate", *extra]
    )


def probes(**over: object) -> Probes:
    base = Probes(
        python=lambda: "3.11.7",
        versions=lambda: {"torch": "2.7.0", "transformers": "4.56.0", "sglang": "0.5.23", "flash-attn": None},
        requirements=lambda: {"torch": ">=2.6", "transformers": ">=4.51", "sglang": "==0.5.23"},
        torch_cuda=lambda: "12.8",
        gpus=lambda: ("570.1", [Gpu("H100", 80 * GiB, 79 * GiB)] * 2),
        ray=lambda: "no cluster (test)",
        disk_free=lambda path: 100 * GiB,
        tokenizer=lambda path: WordTokenizer(),
    )
    for name, value in over.items():
        setattr(base, name, value)
    return base


def by_check(rows: list[Row]) -> dict[str, Row]:
    return {r.check: r for r in rows}


def test_a_good_setup_has_no_blocker_and_exits_zero(setup, capsys) -> None:
    rows = doctor.doctor_rows(
        cfg_for(setup, "--rollout-max-prompt-len", "4", "--save", str(setup["save"])), probes()
    )
    assert [r for r in rows if r.status != OK] == [
        Row("flash-attn", WARN, rows[4].detail)
    ]  # GPUs, no flash-attn
    got = by_check(rows)
    assert "toy, 10.00K parameters" in got["model"].detail
    assert (
        "2 of all 3 prompts fit --rollout-max-prompt-len=4 (shortest: 1 tokens)" in got["prompt data"].detail
    )
    assert "driver 570.1, 2 x H100" in got["GPUs"].detail
    argv = ["--hf-checkpoint", str(setup["model"]), "--prompt-data", str(setup["data"]), "--rm-type", "math"]
    argv += ["--num-rollout", "1", "--rollout-batch-size", "1", "--global-batch-size", "1", "--colocate"]
    assert doctor.main(argv, probes()) == 0
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0].split() == ["check", "status", "detail"] and "0 blocker(s), 1 warning(s)" in out
    )


def test_missing_model_dir_is_a_blocker(setup, tmp_path, capsys) -> None:
    setup["model"] = tmp_path / "nope"
    rows = by_check(doctor.doctor_rows(cfg_for(setup), probes()))
    assert rows["model"].status == BLOCKER and "directory does not exist" in rows["model"].detail
    assert "memory" not in rows  # no parameter count to estimate from
    assert rows["pre-flight"].status == OK  # the model's problem is shown once, in its own row
    argv = ["--hf-checkpoint", str(setup["model"]), "--prompt-data", str(setup["data"]), "--rm-type", "math"]
    argv += ["--num-rollout", "1", "--rollout-batch-size", "1", "--global-batch-size", "1", "--colocate"]
    assert doctor.main(argv, probes()) == 1
    assert "1 blocker(s)" in capsys.readouterr().out


def test_unparsable_data_is_a_blocker(setup, tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"input": "a", "label": "x"\n')
    setup["data"] = tmp_path / "bad.jsonl"
    row = by_check(doctor.doctor_rows(cfg_for(setup), probes()))["prompt data"]
    assert row.status == BLOCKER and "line 1: not valid JSON" in row.detail
    write_prompts(tmp_path / "nokey.jsonl", ["a"])
    setup["data"] = tmp_path / "nokey.jsonl"
    row = by_check(doctor.doctor_rows(cfg_for(setup, "--input-key", "prompt"), probes()))["prompt data"]
    assert row.status == BLOCKER and "missing key 'prompt'" in row.detail


def test_no_prompt_fits_is_a_blocker_when_the_whole_file_was_read(setup, monkeypatch) -> None:
    cfg = cfg_for(setup, "--rollout-max-prompt-len", "2", "--apply-chat-template")  # chat: +2 tokens each
    row = by_check(doctor.doctor_rows(cfg, probes()))["prompt data"]
    assert (
        row.status == BLOCKER
        and "0 of all 3 prompts fit" in row.detail
        and "shortest: 3 tokens" in row.detail
    )
    monkeypatch.setattr(doctor, "FIT_ROWS", 2)  # the file goes on past the rows read: a warning only
    row = by_check(doctor.doctor_rows(cfg, probes()))["prompt data"]
    assert row.status == WARN and "0 of the first 2 prompts" in row.detail


def test_prompt_fit_problem_for_miles_train(setup, caplog) -> None:
    tok = WordTokenizer()
    assert doctor.prompt_fit_problem(cfg_for(setup), tok) is None  # --rollout-max-prompt-len unset
    assert (
        doctor.prompt_fit_problem(cfg_for(setup, "--rollout-max-prompt-len", "1"), tok) is None
    )  # "one" fits
    problem = doctor.prompt_fit_problem(
        cfg_for(setup, "--rollout-max-prompt-len", "1", "--apply-chat-template"), tok
    )
    assert problem is not None and problem.startswith(
        f"--prompt-data={str(setup['data'])!r}: 0 of all 3 prompts"
    )
    assert "raise --rollout-max-prompt-len" in problem
    with caplog.at_level("WARNING"):
        cfg = cfg_for(setup, "--rollout-max-prompt-len", "2")
        assert (
            doctor.prompt_fit_problem(cfg, tok, limit=1) is None
        )  # only 'a b c' read: too long, not conclusive
    assert "0 of the first 1 prompts" in caplog.text
    write_prompts(setup["data"], ["a"])
    with open(setup["data"], "a") as f:
        f.write(
            '{"label": "x"}\n'
        )  # the second row lacks the prompt: the dataset would fail after Ray started
    problem = doctor.prompt_fit_problem(cfg_for(setup, "--rollout-max-prompt-len", "2"), tok)
    assert problem is not None and "line 2: missing key 'input'" in problem


def test_disk_too_small_is_a_blocker_and_tight_disk_a_warning(setup) -> None:
    cfg = cfg_for(setup, "--save", str(setup["save"]))  # 10k params * (4 fp32 + 8 Adam) = 120,000 bytes
    assert doctor.checkpoint_bytes(cfg, 10_000) == 120_000
    row = by_check(doctor.doctor_rows(cfg, probes(disk_free=lambda p: 100_000)))["disk"]
    assert row.status == BLOCKER and "--save needs more room" in row.detail
    assert by_check(doctor.doctor_rows(cfg, probes(disk_free=lambda p: 200_000)))["disk"].status == WARN
    asked = []
    doctor.doctor_rows(cfg, probes(disk_free=lambda p: asked.append(p) or GiB))
    assert asked == [str(setup["save"].parent)]  # the nearest existing directory of a --save not made yet
    with_hf = cfg_for(setup, "--save", str(setup["save"]), "--save-hf", str(setup["save"]) + "/hf")
    assert doctor.checkpoint_bytes(with_hf, 10_000) == 140_000


def test_training_state_larger_than_gpu_memory_is_a_blocker(setup, tmp_path) -> None:
    # 1M params: 16 MB of Adam training state on one rank, 8 MB on each of two (> 80% of 9 MiB free)
    setup["model"] = write_model(tmp_path / "big", shape=(1000, 1000))
    small = probes(gpus=lambda: ("570.1", [Gpu("T4", 16 * 2**20, 9 * 2**20)]))
    row = by_check(doctor.doctor_rows(cfg_for(setup), small))["memory"]
    assert row.status == BLOCKER and "add GPUs or --fsdp-cpu-offload" in row.detail
    two = cfg_for(setup, "--actor-num-gpus-per-node", "2")
    assert doctor.train_state_bytes(two, 1_000_000) == 8_000_000
    assert by_check(doctor.doctor_rows(two, small))["memory"].status == WARN
    offload = by_check(doctor.doctor_rows(cfg_for(setup, "--fsdp-cpu-offload"), small))["memory"]
    assert offload.status == OK and "--fsdp-cpu-offload" in offload.detail
    assert doctor.train_state_bytes(cfg_for(setup, "--optimizer", "sgd"), 1_000_000) == 8_000_000


def test_versions_against_pyproject(setup) -> None:
    p = probes(versions=lambda: {"sglang": "0.5.22", "transformers": None, "ring-flash-attn": None})
    rows = by_check(doctor.doctor_rows(cfg_for(setup), p))
    assert rows["sglang"] == Row("sglang", WARN, "0.5.22 (pyproject: ==0.5.23): not the tested version")
    assert rows["transformers"].status == BLOCKER  # a core dependency
    assert rows["ring-flash-attn"].status == WARN  # the gpu extra, GPUs visible
    cpu = by_check(doctor.doctor_rows(cfg_for(setup), probes(versions=p.versions, gpus=lambda: (None, []))))
    assert cpu["ring-flash-attn"].status == OK and cpu["GPUs"].detail.startswith("none visible")
    reqs = doctor.tested_requirements()  # the real pins, read from pyproject.toml
    assert (
        reqs["sglang"].startswith("==") and reqs["ring-flash-attn"].startswith("==") and "flash-attn" in reqs
    )


def test_cluster_with_too_few_gpus_is_a_blocker(setup) -> None:
    cfg = cfg_for(setup, "--actor-num-gpus-per-node", "4")
    row = by_check(doctor.doctor_rows(cfg, probes(ray=lambda: RayView("ray://head:10001", 1, 2.0, 32.0))))
    assert row["ray cluster"].status == BLOCKER and "the layout needs 4 GPUs" in row["ray cluster"].detail
    cpu_only = by_check(doctor.doctor_rows(cfg, probes(ray=lambda: RayView("local", 1, 0.0, 8.0))))
    assert cpu_only["ray cluster"].status == OK
    assert by_check(doctor.doctor_rows(cfg, probes()))["ray cluster"] == Row(
        "ray cluster", OK, "no cluster (test)"
    )


def test_preflight_problems_are_blockers(setup) -> None:
    row = by_check(doctor.doctor_rows(cfg_for(setup, "--custom-rm-path", "no_such_mod:fn"), probes()))[
        "pre-flight"
    ]
    assert row.status == BLOCKER and "--custom-rm-path" in row.detail and "no_such_mod" in row.detail


def test_nvidia_smi_without_driver_and_ray_without_cluster(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert doctor.nvidia_smi() == (None, [])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(doctor, "_LOCAL_RAY", tmp_path / "ray_current_cluster")
    assert doctor.ray_view().startswith("no cluster (RAY_ADDRESS is not set")  # nothing started


def test_format_table_continues_multiline_details() -> None:
    text = doctor.format_table([Row("a", OK, "x"), Row("model", BLOCKER, "one\ntwo")])
    assert text.splitlines() == [
        "check  status   detail",
        "a      OK       x",
        "model  BLOCKER  one",
        "                two",
    ]
    assert doctor.exit_code([Row("a", WARN, "")]) == 0 and doctor.exit_code([Row("a", BLOCKER, "")]) == 1
