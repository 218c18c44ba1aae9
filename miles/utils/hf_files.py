"""Checks of a HuggingFace model directory that need no torch or transformers: files present, JSON readable,
safetensors complete. Each problem names the flag and the file, so a bad path fails before anything starts.

safetensors layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N
bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data
buffer, whose length must equal the largest ``end``. A file cut short (an interrupted copy or download) is
caught by comparing that with its size.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MAX_HEADER = 100_000_000  # the limit of the safetensors library


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the safetensors file `path` is unreadable or truncated, or None when its header and size agree."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{p} is truncated: {size} bytes, shorter than the 8-byte safetensors header length"
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                return f"{p} is not a safetensors file (header length {n} bytes is implausible)"
            raw = f.read(n)
    except OSError as e:
        return f"{p} cannot be read: {e.strerror or e}"
    if len(raw) < n:
        return f"{p} is truncated: {size} bytes, but its header alone needs {8 + n}"
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{p} has a corrupt safetensors header ({e})"
    if not isinstance(header, dict):
        return f"{p} has a corrupt safetensors header (not a JSON object)"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            return f"{p} has a corrupt safetensors header (tensor {name!r} has no valid data_offsets)"
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size < expected:
        return f"{p} is truncated: {size} bytes, but its header describes {expected}"
    if size > expected:
        return f"{p} is corrupt: {size} bytes, but its header describes {expected}"
    return None


def _json_problem(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        return f"{path} cannot be read: {e.strerror or e}"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{path} is not valid JSON ({e})"
    return None if isinstance(data, dict) else f"{path} is not a JSON object"


def _index_shards(index: Path) -> tuple[list[Path], str | None]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted({index.parent / name for name in weight_map.values()}), None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [], f"{index} is not a valid weight index ({type(e).__name__}: {e})"


def hf_dir_problems(path: str | None, flag: str, need_tokenizer: bool = True) -> list[str]:
    """Problems of the HuggingFace model directory `path` given by `flag` (empty when it looks loadable).

    Checks: the directory exists (a hub repo id is not accepted: runs are offline), ``config.json`` is a
    readable JSON object, weights exist (every shard an index names too) and every ``*.safetensors`` file is
    complete, and with `need_tokenizer` a tokenizer file exists."""
    if not path:
        return [f"{flag} is not set"]
    root = Path(path)
    if not root.exists():
        return [
            f"{flag}={path!r}: directory does not exist (a local HuggingFace model directory is expected)"
        ]
    if not root.is_dir():
        return [f"{flag}={path!r}: is a file, not a HuggingFace model directory"]
    problems = []
    config = root / "config.json"
    if not config.is_file():
        problems.append(f"{flag}={path!r}: no config.json in the directory")
    elif (problem := _json_problem(config)) is not None:
        problems.append(f"{flag}: {problem}")
    present = [name for name in WEIGHT_FILES if (root / name).is_file()]
    if not present:
        problems.append(f"{flag}={path!r}: no weights (none of {', '.join(WEIGHT_FILES)})")
    shards = sorted(root.glob("*.safetensors"))
    if "model.safetensors.index.json" in present:
        listed, problem = _index_shards(root / "model.safetensors.index.json")
        if problem:
            problems.append(f"{flag}: {problem}")
        for shard in listed:
            if not shard.is_file():
                problems.append(
                    f"{flag}: {shard} is named by model.safetensors.index.json but does not exist"
                )
    for shard in shards:
        if (problem := safetensors_problem(shard)) is not None:
            problems.append(f"{flag}: {problem}")
    if need_tokenizer and not any((root / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"{flag}={path!r}: no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return problems


def check_hf_dir(path: str, flag: str, need_tokenizer: bool = True) -> None:
    """Raise ValueError listing `hf_dir_problems` (one per line) when there are any."""
    problems = hf_dir_problems(path, flag, need_tokenizer)
    if problems:
        raise ValueError("\n".join(problems))
