"""Tiny model + tokenizer builder and toy data: offline round trip, chat template, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.tools import toy_data
from miles.tools.tiny_model import CHAT_TEMPLATE, build_tiny_model, build_tokenizer

SIZES = dict(hidden_size=32, num_layers=2, num_heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3, **SIZES)


def test_round_trip_loads_offline_and_runs(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (model_dir / "model.safetensors").is_file()
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x as well
    assert not model_dir.with_name("model.tmp").exists()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok)
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    ids = tok("echo 7", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(logits).all()


def test_chat_template_and_special_tokens(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "echo 1"}, {"role": "user", "content": "echo 7"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\necho 1<|im_end|>\n<|im_start|>user\necho 7<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[1:], tokenize=False).endswith("<|im_end|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # lossless
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert ids.count(tok.convert_tokens_to_ids(special)) == text.count(special)
    assert tok.decode(ids, skip_special_tokens=True) == "system\necho 1\nuser\necho 7\nassistant\n"
    assert (
        tok.decode(
            tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], skip_special_tokens=True
        )
        == "7"
    )
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digits)) == 10 and tok.unk_token_id not in digits  # every digit is its own token


def test_deterministic_for_seed(tmp_path: Path, model_dir: Path) -> None:
    from safetensors.torch import load_file

    again = build_tiny_model(tmp_path / "again", seed=3, **SIZES)
    other = build_tiny_model(tmp_path / "other", seed=4, **SIZES)
    a, b, c = (load_file(p / "model.safetensors") for p in (model_dir, again, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (model_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 2


def test_existing_dir_needs_overwrite(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", seed=0, **SIZES)
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_tiny_model(out, seed=0, **SIZES)
    (out / "stale.txt").write_text("x")
    build_tiny_model(out, seed=1, overwrite=True, **SIZES)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()


def test_cli_builds_and_refuses_to_clobber(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from miles.tools.tiny_model import main

    out = tmp_path / "cli"
    main(["--out", str(out), "--hidden-size", "32", "--num-heads", "2", "--num-layers", "1", "--seed", "5"])
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(SystemExit):
        main(["--out", str(out)])
    assert "already exists" in capsys.readouterr().err


def test_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tmp_path / "m", hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="vocab_size=10 is too small"):
        build_tokenizer(vocab_size=10)
    with pytest.raises(ValueError, match="unknown toy task 'nope'"):
        build_tokenizer("nope")


def test_word_model_into_an_empty_dir(tmp_path: Path) -> None:
    """The word-level variant: exact vocabulary, unknown words to <unk>, untied and sharp weights; the global RNG
    is left as it was; an existing empty directory (a pytest `mktemp`) is filled, not refused."""
    from transformers import AutoTokenizer

    from miles.tools.tiny_model import WORDS, build_word_model

    (tmp_path / "m").mkdir()
    before = torch.random.get_rng_state()
    out = build_word_model(tmp_path / "m", seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 3 + len(WORDS)
    assert tok("the cat zebra", add_special_tokens=False)["input_ids"] == [3, 3 + WORDS.index("cat"), 1]
    assert (tok.pad_token_id, tok.unk_token_id, tok.eos_token_id) == (0, 1, 2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == len(tok)
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert 0.25 < weights["model.layers.0.mlp.up_proj.weight"].std().item() < 0.35  # N(0, 0.3), not HF's 0.02


def test_word_tokenizer_refuses_bpe_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer='bpe' only"):
        build_tiny_model(tmp_path / "m", tokenizer="words", extra_texts=["x"])
    from miles.tools.tiny_model import word_tokenizer

    with pytest.raises(ValueError, match="repeat or collide"):
        word_tokenizer(["a", "<eos>"])


def test_template_constant_matches_tokenizer() -> None:
    assert build_tokenizer().chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("task", sorted(toy_data.TASKS))
def test_toy_rows_deterministic_and_encodable(task: str, tmp_path: Path) -> None:
    rows = toy_data.make_rows(task, 50, seed=1)
    assert rows == toy_data.make_rows(task, 50, seed=1)
    assert rows != toy_data.make_rows(task, 50, seed=2)
    chat_rows = toy_data.make_rows(task, 50, seed=1, fmt="chat")
    assert [r["prompt"] for r in chat_rows] == [[{"role": "user", "content": r["prompt"]}] for r in rows]
    tok = build_tokenizer(task)
    for row, chat_row in zip(rows, chat_rows):
        assert row["prompt"].endswith(row["label"])  # echo: the answer is the prompt's last token
        text = tok.apply_chat_template(chat_row["prompt"], tokenize=False, add_generation_prompt=True)
        for t in (text, row["prompt"], row["label"]):
            assert tok.decode(tok(t, add_special_tokens=False)["input_ids"]) == t  # no dropped characters
    path = toy_data.write_jsonl(rows, tmp_path / "d.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    with pytest.raises(ValueError, match="unknown format 'yaml'"):
        toy_data.make_rows(task, 1, fmt="yaml")


def test_toy_data_cli(tmp_path: Path) -> None:
    toy_data.main(["--task", "echo", "--out", str(tmp_path / "x.jsonl"), "--n", "7", "--seed", "3"])
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert rows == toy_data.make_rows("echo", 7, seed=3)
    assert {r["label"] for r in toy_data.make_rows("echo", 200)} == set("0123")


def test_check_learnability_runs(model_dir: Path) -> None:
    from miles.tools.check_learnability import run

    stats = run(steps=2, prompts_per_step=2, n=4, model_dir=str(model_dir))
    assert [s.step for s in stats] == [0, 1]
    assert all(0.0 <= s.mean_reward <= 1.0 for s in stats)


@pytest.mark.slow
def test_echo_task_is_learned_by_grpo() -> None:
    """The toy task's promise: plain GRPO takes the tiny model from ~5% to well above 35% reward."""
    from miles.tools.check_learnability import run

    torch.set_num_threads(1)
    rewards = [s.mean_reward for s in run(task="echo", steps=30, prompts_per_step=16, n=8, lr=5e-3, seed=0)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first <= 0.2 and last >= first + 0.3, rewards


def test_learnability_loss_has_the_reinforce_gradient_of_a_loop(model_dir: Path) -> None:
    """The learnability check's loss (miles.algo's, on-policy) has the gradient of REINFORCE written as a loop
    over unpadded sequences: -sum_i sum_t adv_i * log p(y_it) / (response tokens)."""
    from transformers import AutoModelForCausalLM

    from miles.tools.check_learnability import _group_advantages, _loss

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]
    responses = [[11, 2], [12, 13, 14], [4]]
    adv = [1.5, -0.5, 0.25]
    model.zero_grad()
    _loss(model, prompts, responses, adv, pad_id=0).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total, count = 0.0, 0
    for p, r, a in zip(prompts, responses, adv):
        logits = model(torch.tensor([p + r])).logits[0].float()
        for t, token in enumerate(r):
            total = total - a * torch.log_softmax(logits[len(p) + t - 1], dim=-1)[token]
            count += 1
    (total / count).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)
    # GRPO advantages of two prompts x 3 samples: within-group, equal rewards give 0
    assert _group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 3)[3:] == [0.0, 0.0, 0.0]
    a = _group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 3)[:3]
    assert a[0] > 0 > a[1] == a[2]
