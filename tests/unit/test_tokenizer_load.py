"""`miles.utils.tokenizer_load`: the rollout manager's tokenizer is AutoTokenizer's, loaded without torch where the
checkpoint declares the generic class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.utils.tokenizer_load import direct_class, load_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from miles.tools.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer("echo").save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return out


def _edit(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_generic_class_loads_like_auto_tokenizer(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert direct_class(str(tok_dir))
    ours, auto = load_tokenizer(str(tok_dir)), AutoTokenizer.from_pretrained(str(tok_dir))
    assert type(ours) is type(auto)
    msgs = [{"role": "user", "content": "echo 7"}]
    for t in ("echo 3", "hello 12 <|im_end|>"):
        assert ours.encode(t) == auto.encode(t)
    assert ours.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.all_special_ids,
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"tokenizer_class": "Qwen2Tokenizer"},  # a model-specific class: AutoTokenizer resolves it
        {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}},  # remote code
    ],
)
def test_other_checkpoints_go_through_auto_tokenizer(tok_dir: Path, tmp_path: Path, changes: dict) -> None:
    assert not direct_class(str(_edit(tok_dir, tmp_path / "t", **changes)))


def test_overridden_model_type_and_tekken_go_through_auto_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    internlm = _edit(tok_dir, tmp_path / "internlm")
    (internlm / "config.json").write_text(
        json.dumps({"model_type": "internlm2"})
    )  # transformers overrides it
    assert not direct_class(str(internlm))
    mistral = _edit(tok_dir, tmp_path / "mistral")
    (mistral / "tekken.json").write_text("{}")
    assert not direct_class(str(mistral))
    assert not direct_class(str(tmp_path / "missing"))
