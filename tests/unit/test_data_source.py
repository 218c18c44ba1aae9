"""PromptDataset (JSONL/Parquet, errors, tokenization) and RolloutDataSource (groups, shuffle, resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.rollout.data_source import PromptDataset, RolloutDataSource, check_first_row, copy_json
from miles.utils.types import Sample


class CharTokenizer:
    """A tokenizer stand-in: one id per character, a fixed chat template."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:  # noqa: ANN001
        assert not tokenize
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _dataset(path: Path, **kw) -> PromptDataset:  # noqa: ANN003
    args = dict(
        input_key="prompt",
        label_key="label",
        metadata_key="meta",
        tokenizer=CharTokenizer(),
        apply_chat_template=False,
    )
    args.update(kw)
    return PromptDataset(path, **args)


def test_jsonl_plain_prompts(tmp_path: Path) -> None:
    p = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "ab", "label": "1", "meta": {"k": 1}}, "", {"prompt": "c", "label": 2}],
    )
    ds = _dataset(p)
    assert len(ds) == 2
    assert ds[0].prompt_ids == [1, ord("a"), ord("b")] and ds[0].label == "1" and ds[0].metadata == {"k": 1}
    assert ds[1].prompt_ids == [1, ord("c")] and ds[1].label == 2 and ds[1].metadata == {}


def test_chat_template_prompts(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}, {"prompt": "yo", "label": "y"}]
    ds = _dataset(_write_jsonl(tmp_path / "d.jsonl", rows), apply_chat_template=True)
    assert ds[0].prompt_ids == [ord(c) for c in "<user>hi<assistant>"]  # no extra special tokens
    assert ds[1].prompt_ids == [ord(c) for c in "<user>yo<assistant>"]  # a string is one user message
    assert ds[0].prompt == [{"role": "user", "content": "hi"}]


def test_messages_without_chat_template_rejected(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}])
    with pytest.raises(ValueError, match=r"d.jsonl: line 1: .*--apply-chat-template"):
        _dataset(p)


def test_missing_key_names_file_line_and_key(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, "", {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 3: missing key 'label'"):
        _dataset(p)
    p2 = _write_jsonl(tmp_path / "e.jsonl", [{"question": "a", "label": "1"}])
    with pytest.raises(ValueError, match=r"e\.jsonl: line 1: missing key 'prompt'"):
        _dataset(p2)


def test_bad_json_line(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, "{not json"])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: not valid JSON"):
        _dataset(p)
    p2 = _write_jsonl(tmp_path / "e.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"e\.jsonl: line 1: expected a JSON object"):
        _dataset(p2)


def test_bad_metadata_and_messages(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1", "meta": [1]}])
    with pytest.raises(ValueError, match=r"line 1: key 'meta' must be an object"):
        _dataset(p)
    p2 = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": [{"content": "x"}], "label": "1"}])
    with pytest.raises(
        ValueError, match=r"line 1: key 'prompt': each chat message needs 'role' and 'content'"
    ):
        _dataset(p2, apply_chat_template=True)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        _dataset(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported suffix '\.csv'"):
        _dataset(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no usable rows"):
        _dataset(tmp_path / "empty.jsonl")


def test_non_utf8_line_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": "1"}\n{"prompt": "caf\xe9", "label": "2"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        _dataset(p)
    check_first_row(p, "prompt", "label", None, False)  # the byte-order mark of line 1 is accepted


def test_check_first_row_reads_only_the_first_row(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", ["", {"prompt": "a", "label": 1}, "{broken"])
    check_first_row(p, "prompt", "label", "meta", False)
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: missing key 'answer'"):
        check_first_row(p, "prompt", "answer", "meta", False)
    with pytest.raises(ValueError, match=r"line 2: key 'prompt' is a list, not a string"):
        check_first_row(
            _write_jsonl(tmp_path / "m.jsonl", ["", {"prompt": [1]}]), "prompt", None, None, False
        )
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl has no rows"):
        check_first_row(tmp_path / "empty.jsonl", "prompt", None, None, False)
    with pytest.raises(ValueError, match=r"is not a file"):
        check_first_row(tmp_path, "prompt", None, None, False)


def test_no_label_key(tmp_path: Path) -> None:
    ds = _dataset(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}]), label_key=None, metadata_key=None)
    assert ds[0].label is None


def test_max_prompt_len_filters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": 1}, {"prompt": "abcdef", "label": 2}])
    with caplog.at_level("WARNING", logger="miles.rollout.data_source"):
        ds = _dataset(p, max_prompt_len=3)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds[0].label == 1
    assert "dropped 1 of 2 prompts longer than --rollout-max-prompt-len=3 tokens" in caplog.text
    assert "d.jsonl: line 2 (7 tokens)" in caplog.text
    with pytest.raises(
        ValueError, match="no usable rows \\(all 2 longer than --rollout-max-prompt-len=1 tokens"
    ):
        _dataset(p, max_prompt_len=1)


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"prompt": ["ab", "c", "d"], "label": ["1", "2", "3"], "meta": [{"k": 1}, {"k": 2}, None]}
    )
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)  # two row groups: row numbers run on
    ds = _dataset(tmp_path / "d.parquet")
    assert [r.label for r in ds.records] == ["1", "2", "3"]
    assert ds[0].prompt_ids == [1, ord("a"), ord("b")] and ds[1].metadata == {"k": 2} and ds[2].metadata == {}

    bad = pa.table({"prompt": ["a", "b", "c"], "label": ["1", "2", None]})
    pq.write_table(bad, tmp_path / "bad.parquet", row_group_size=2)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 3: missing key 'label'"):
        _dataset(tmp_path / "bad.parquet")

    data = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.parquet: cannot read as Parquet"):
        _dataset(tmp_path / "cut.parquet")


@pytest.fixture
def ds(tmp_path: Path) -> PromptDataset:
    rows = [{"prompt": f"p{i}", "label": str(i), "meta": {"i": i}} for i in range(5)]
    return _dataset(_write_jsonl(tmp_path / "d.jsonl", rows))


def _labels(batch: list[list[Sample]]) -> list[str]:
    return [g[0].label for g in batch]


def test_groups_and_samples(ds: PromptDataset) -> None:
    src = RolloutDataSource(ds, n_samples_per_prompt=3, shuffle=False, seed=0)
    batch = src.next_batch(2)
    assert len(batch) == 2 and all(len(g) == 3 for g in batch)
    flat = [s for g in batch for s in g]
    assert [s.index for s in flat] == list(range(6))
    assert [s.group_index for s in flat] == [0, 0, 0, 1, 1, 1]
    assert [s.label for s in flat] == ["0"] * 3 + ["1"] * 3
    assert flat[0].tokens == ds[0].prompt_ids and flat[0].prompt == "p0" and flat[0].response_length == 0
    flat[0].metadata["x"] = 1
    flat[0].tokens.append(99)
    assert flat[1].metadata == {"i": 0} and ds[0].metadata == {"i": 0}  # copies, not shared
    assert flat[1].tokens == ds[0].prompt_ids


def test_copy_json_copies_containers_at_every_depth() -> None:
    """Each sample's prompt, label and metadata are its own: nested dicts and lists are rebuilt, scalars kept,
    and a value JSON cannot hold (a set, from a Parquet file's odd column) is deep-copied."""
    value = {"messages": [{"role": "user", "content": "hi", "extra": [1, 2.5, None, True]}], "tags": {3}}
    copied = copy_json(value)
    assert copied == value
    copied["messages"][0]["extra"].append(9)
    copied["messages"][0]["content"] = "changed"
    copied["tags"].add(4)
    assert value == {
        "messages": [{"role": "user", "content": "hi", "extra": [1, 2.5, None, True]}],
        "tags": {3},
    }


def test_epochs_wrap_without_shuffle(ds: PromptDataset) -> None:
    src = RolloutDataSource(ds, n_samples_per_prompt=1, shuffle=False, seed=0)
    assert _labels(src.next_batch(3)) == ["0", "1", "2"]
    assert _labels(src.next_batch(4)) == ["3", "4", "0", "1"]
    assert src.state_dict() == {"epoch": 1, "offset": 2}
    assert _labels(src.next_batch(12)) == ["2", "3", "4"] + ["0", "1", "2", "3", "4"] * 1 + [
        "0",
        "1",
        "2",
        "3",
    ]


def test_shuffle_deterministic_per_seed_and_epoch(ds: PromptDataset) -> None:
    def order(seed: int) -> list[str]:
        return _labels(RolloutDataSource(ds, 1, shuffle=True, seed=seed).next_batch(20))

    a = order(1)
    assert a == order(1)
    epochs = [a[i : i + 5] for i in range(0, 20, 5)]
    assert all(sorted(e) == ["0", "1", "2", "3", "4"] for e in epochs)  # each epoch is a permutation
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    assert any(order(s) != a for s in range(2, 6))  # seed matters


def test_resume_from_state_dict(ds: PromptDataset) -> None:
    src = RolloutDataSource(ds, 2, shuffle=True, seed=7)
    src.next_batch(3)
    src.next_batch(4)  # crosses into epoch 1
    state = src.state_dict()
    expected = [_labels(src.next_batch(3)) for _ in range(4)]
    resumed = RolloutDataSource(ds, 2, shuffle=True, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [_labels(resumed.next_batch(3)) for _ in range(4)] == expected


def test_bad_arguments(ds: PromptDataset) -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        RolloutDataSource(ds, 0, shuffle=False, seed=0)
    src = RolloutDataSource(ds, 1, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="num_prompts"):
        src.next_batch(0)
    with pytest.raises(ValueError, match="keys 'epoch' and 'offset'"):
        src.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="offset=9 does not fit a dataset of 5"):
        src.load_state_dict({"epoch": 0, "offset": 9})


@pytest.mark.parametrize("fmt", ["plain", "chat"])
def test_toy_data_with_tiny_tokenizer(tmp_path: Path, fmt: str) -> None:
    """The toy dataset through the tiny model's real tokenizer: ids decode back to the prompt text."""
    from miles.tools.tiny_model import build_tokenizer
    from miles.tools.toy_data import make_rows, write_jsonl

    tok = build_tokenizer("echo")
    path = write_jsonl(make_rows("echo", 20, seed=0, fmt=fmt), tmp_path / "toy.jsonl")
    ds = PromptDataset(path, "prompt", "label", None, tok, apply_chat_template=fmt == "chat")
    assert len(ds) == 20
    for rec in ds.records:
        text = tok.decode(rec.prompt_ids)
        if fmt == "plain":
            assert text == rec.prompt and text.endswith(rec.label)
        else:
            content = rec.prompt[0]["content"]
            assert text == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
