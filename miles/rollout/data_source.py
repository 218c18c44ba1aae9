"""Prompt data: a tokenized prompt dataset (JSONL or Parquet) and the cursor that hands out prompt groups.

Prompts are tokenized once, here; downstream code only sees token ids (`Sample.tokens`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from miles.rollout.multimodal import VLProcessor

logger = logging.getLogger(__name__)
V = TypeVar("V")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class PromptRecord:
    """One dataset row after tokenization."""

    prompt: str | list[dict[str, str]]  # as in the file: a string, or chat messages
    prompt_ids: list[int]  # [prompt_len]
    label: JSON = None
    metadata: dict[str, JSON] = field(default_factory=dict)
    multimodal_data: dict[str, list[str]] | None = None  # the row's images as PNG data URIs (Sample's field)


def copy_json(value: V) -> V:
    """A deep copy of a value read from a prompt file: dicts and lists are rebuilt, str/int/float/bool/None are
    immutable and shared; anything else goes through `copy.deepcopy`. A few times faster than `copy.deepcopy` on
    chat messages (no memo, no dispatch table), which matters at one copy per sample per rollout."""
    if isinstance(value, dict):
        return cast(V, {k: copy_json(v) for k, v in value.items()})
    if isinstance(value, list):
        return cast(V, [copy_json(v) for v in value])
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return copy.deepcopy(value)


def _decode_line(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")  # a byte-order mark may open the file
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
            "save the file as UTF-8"
        ) from None


def _iter_jsonl(path: Path) -> Iterator[tuple[str, dict[str, JSON]]]:
    """Yield (location, row) for each non-blank line; location is 'file: line N' (1-based)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}: line {lineno}"
            line = _decode_line(raw, where, first=lineno == 1)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _iter_parquet(path: Path) -> Iterator[tuple[str, dict[str, JSON]]]:
    """Yield (location, row) per Parquet row; location is 'file: row N' (1-based)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rownum = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():
                rownum += 1
                yield f"{path}: row {rownum}", row
    except (pa.ArrowException, OSError) as e:
        raise ValueError(
            f"{path}: cannot read as Parquet after row {rownum} ({type(e).__name__}: {e})"
        ) from e


def iter_rows(path: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, JSON]]]:
    """Rows of a JSONL or Parquet file, each with a human-readable location for error messages."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"prompt data file {p} does not exist")
    if not p.is_file():
        raise ValueError(f"prompt data file {p} is not a file")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _iter_jsonl(p)
    if suffix in PARQUET_SUFFIXES:
        return _iter_parquet(p)
    raise ValueError(
        f"prompt data file {p}: unsupported suffix {suffix!r}; use one of {JSONL_SUFFIXES + PARQUET_SUFFIXES}"
    )


def _check_messages(where: str, key: str, messages: JSON) -> list[dict[str, str]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: key {key!r} must be a string or a non-empty list of chat messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: key {key!r}: each chat message needs 'role' and 'content', got {m!r}")
    return cast("list[dict[str, str]]", messages)  # chat messages, as the tokenizer's template reads them


def check_row(
    where: str,
    row: dict[str, JSON],
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
    apply_chat_template: bool,
) -> tuple[str | list[dict[str, str]], JSON, dict[str, JSON]]:
    """(prompt, label, metadata) of one row, checked without a tokenizer; ValueError naming `where` and the key.

    The prompt is returned as chat messages with `apply_chat_template` (a string becomes one user message),
    else as the string itself."""
    required = [input_key] + ([label_key] if label_key is not None else [])
    for key in required:
        if row.get(key) is None:
            raise ValueError(f"{where}: missing key {key!r} (present: {sorted(row)})")
    raw = row[input_key]
    prompt: str | list[dict[str, str]]
    if apply_chat_template:
        prompt = _check_messages(where, input_key, raw)
    elif isinstance(raw, str):
        prompt = raw
    else:
        raise ValueError(
            f"{where}: key {input_key!r} is a {type(raw).__name__}, not a string; "
            "chat messages need --apply-chat-template"
        )
    metadata = row.get(metadata_key) if metadata_key is not None else None
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise ValueError(f"{where}: key {metadata_key!r} must be an object, got {type(metadata).__name__}")
    label = row[label_key] if label_key is not None else None
    return prompt, label, metadata


def check_first_row(
    path: str | os.PathLike[str],
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
    apply_chat_template: bool,
) -> None:
    """Read only the first row of a prompt file and check it as `PromptDataset` would (a pre-flight check).

    ValueError naming the file, the line or row and the key; also for a missing, empty or unreadable file."""
    for where, row in iter_rows(path):
        check_row(where, row, input_key, label_key, metadata_key, apply_chat_template)
        return
    raise ValueError(f"prompt data file {path} has no rows")


class PromptDataset:
    """Prompts (+ labels, metadata) read from a JSONL or Parquet file and tokenized once.

    `input_key` and (when not None) `label_key` are required in every row: a missing or null value raises
    ValueError naming the file, the 1-based line (JSONL) or row (Parquet) and the key; so does a non-JSON
    line. `metadata_key` is optional per row (missing -> `{}`) but must be an object when present.
    With `apply_chat_template`, the prompt is a list of chat messages (a plain string is taken as one user
    message) rendered with the tokenizer's chat template and a generation prompt; otherwise it must be a
    string, tokenized as is (with the tokenizer's default special tokens). Prompts longer than
    `max_prompt_len` tokens are dropped: counted in `num_filtered` and logged (with the first one's location).

    With `multimodal_keys` (--multimodal-keys) and a VL `processor`, each row's images are read from those fields
    (a bad image: ValueError naming the row and the field), the prompt is rendered by the processor (the chat
    template with one image part per image, a string prompt taken as one user message) and its ids are the
    expanded ones (one image pad token per merged patch); the images are kept as PNG data URIs
    (`PromptRecord.multimodal_data`, `{"image": [...]}`; None for a row without images).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        input_key: str,
        label_key: str | None,
        metadata_key: str | None,
        tokenizer: PreTrainedTokenizerBase,
        apply_chat_template: bool,
        max_prompt_len: int | None = None,
        multimodal_keys: dict[str, str] | None = None,
        processor: VLProcessor | None = None,
    ) -> None:
        if multimodal_keys and processor is None:
            raise ValueError(
                "--multimodal-keys needs the checkpoint's VL processor (a Qwen-VL --hf-checkpoint)"
            )
        self.multimodal_keys = multimodal_keys or None
        self.processor = processor
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1 or None, got {max_prompt_len}")
        self.path = Path(path)
        self.records: list[PromptRecord] = []
        self.num_filtered = 0
        first_dropped = None
        for where, row in iter_rows(self.path):
            record = self._make_record(
                where, row, input_key, label_key, metadata_key, tokenizer, apply_chat_template
            )
            if self.multimodal_keys is not None:
                self._add_images(record, where, row)
            if max_prompt_len is not None and len(record.prompt_ids) > max_prompt_len:
                self.num_filtered += 1
                first_dropped = first_dropped or f"{where} ({len(record.prompt_ids)} tokens)"
                continue
            self.records.append(record)
        if self.num_filtered:
            logger.warning(
                "%s: dropped %d of %d prompts longer than --rollout-max-prompt-len=%d tokens (first: %s)",
                self.path,
                self.num_filtered,
                self.num_filtered + len(self.records),
                max_prompt_len,
                first_dropped,
            )
        if not self.records:
            extra = (
                f" (all {self.num_filtered} longer than --rollout-max-prompt-len={max_prompt_len} tokens)"
                if self.num_filtered
                else ""
            )
            raise ValueError(f"prompt data file {self.path} has no usable rows{extra}")

    @staticmethod
    def _make_record(
        where: str,
        row: dict[str, JSON],
        input_key: str,
        label_key: str | None,
        metadata_key: str | None,
        tokenizer: PreTrainedTokenizerBase,
        apply_chat_template: bool,
    ) -> PromptRecord:
        prompt, label, metadata = check_row(
            where, row, input_key, label_key, metadata_key, apply_chat_template
        )
        if apply_chat_template:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        raw = cast("str | list[dict[str, str]]", row[input_key])  # checked by check_row
        return PromptRecord(prompt=raw, prompt_ids=list(ids), label=label, metadata=metadata)

    def _add_images(self, record: PromptRecord, where: str, row: dict[str, JSON]) -> None:
        """The row's images into `record` (data URIs) and its prompt ids re-rendered by the VL processor."""
        from miles.rollout.multimodal import image_data_uri, load_sample_images

        assert self.processor is not None and self.multimodal_keys is not None
        images = load_sample_images(row, self.multimodal_keys, where)
        try:
            ids, _ = self.processor.encode(record.prompt, images)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        record.prompt_ids = ids
        record.multimodal_data = {"image": [image_data_uri(img) for img in images]} if images else None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


class RolloutDataSource:
    """Hands out prompt groups from a `PromptDataset`, epoch after epoch, resumable from `state_dict()`.

    Each epoch visits every prompt once, in an order shuffled by `(seed, epoch)` when `shuffle` (file order
    otherwise). A batch that runs past the end of an epoch continues into the next one.

    It also holds the partial-rollout buffer: prompt groups a rollout could not finish (`add_samples`), which
    the next rollout takes back first (`take_buffered`). The buffer lives in memory only (not in `state_dict`).
    """

    def __init__(self, dataset: PromptDataset, n_samples_per_prompt: int, shuffle: bool, seed: int) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.dataset = dataset
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # prompts of the current epoch already handed out
        self._order = self._epoch_order(0)
        self.buffer: list[list[Sample]] = []  # unfinished groups of earlier rollouts, oldest first

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self, num_prompts: int) -> list[list[Sample]]:
        """The next `num_prompts` prompt groups of `n_samples_per_prompt` fresh Samples each.

        `group_index` is the group's position in this batch and `index` the sample's (`g * n + j`);
        `tokens` are the prompt ids. Each sample gets its own copy of the metadata.
        """
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        groups: list[list[Sample]] = []
        n = self.n_samples_per_prompt
        for g in range(num_prompts):
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            record = self.dataset[self._order[self.offset]]
            self.offset += 1
            groups.append(
                [
                    Sample(
                        index=g * n + j,
                        group_index=g,
                        prompt=copy_json(record.prompt),
                        tokens=list(record.prompt_ids),
                        label=copy_json(record.label),
                        metadata=copy_json(record.metadata),
                        multimodal_data=copy_json(record.multimodal_data),
                    )
                    for j in range(n)
                ]
            )
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Hand back prompt groups to be continued by a later rollout (partial rollout)."""
        self.buffer.extend(groups)

    def take_buffered(self, max_groups: int) -> list[list[Sample]]:
        """Up to `max_groups` groups from the buffer, oldest first (removed from it)."""
        taken, self.buffer = self.buffer[:max_groups], self.buffer[max_groups:]
        return taken

    def state_dict(self) -> dict[str, int]:
        """The cursor: `{"epoch": ..., "offset": ...}` (the order is recomputed from the seed on load)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a `state_dict()`; ValueError when it is malformed or does not fit this dataset."""
        if set(state) != {"epoch", "offset"}:
            raise ValueError(f"data source state must have keys 'epoch' and 'offset', got {sorted(state)}")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self.dataset):
            raise ValueError(
                f"data source state epoch={epoch}, offset={offset} does not fit "
                f"a dataset of {len(self.dataset)} prompts"
            )
        self.epoch, self.offset = epoch, offset
        self._order = self._epoch_order(epoch)
