"""`miles.utils.transformers_scan.scan_once`: a folder's scan is kept on disk and reused while every file under the
folder is as it was; a change, an unreadable or unwritable cache, or `MILES_IMPORT_CACHE=off` scans again."""

from __future__ import annotations

import os

import pytest

from miles.utils import transformers_scan as ts


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "models"
    (root / "llama").mkdir(parents=True)
    (root / "llama" / "modeling_llama.py").write_text("__all__ = ['LlamaModel']\n")
    ts._fingerprint.cache_clear()  # each test's folder as it is now
    yield root
    ts._fingerprint.cache_clear()


def scanner(calls: list):
    def scan(folder, prefix=None):
        calls.append((folder, prefix))
        names = sorted(p.stem for p in folder.rglob("*.py"))
        return {
            frozenset(): {f"{prefix}.{n}" if prefix else n: {n.upper()} for n in names},
            frozenset({"torch"}): {},
        }

    return scan


def test_kept_then_reused_with_the_same_answer(folder, tmp_path):
    calls: list = []
    first = ts.scan_once(scanner(calls), folder, "models", tmp_path / "cache")
    again = ts.scan_once(scanner(calls), folder, "models", tmp_path / "cache")
    assert (
        again
        == first
        == {frozenset(): {"models.modeling_llama": {"MODELING_LLAMA"}}, frozenset({"torch"}): {}}
    )
    assert len(calls) == 1
    assert ts.scan_once(scanner(calls), folder, None, tmp_path / "cache") == {
        frozenset(): {"modeling_llama": {"MODELING_LLAMA"}},
        frozenset({"torch"}): {},
    }  # another prefix is another answer
    assert len(calls) == 2


def test_a_changed_file_scans_again(folder, tmp_path):
    calls: list = []
    ts.scan_once(scanner(calls), folder, None, tmp_path / "cache")
    (folder / "llama" / "modeling_qwen.py").write_text("__all__ = ['QwenModel']\n")
    ts._fingerprint.cache_clear()  # a new process
    answer = ts.scan_once(scanner(calls), folder, None, tmp_path / "cache")
    assert len(calls) == 2 and "modeling_qwen" in answer[frozenset()]
    old = folder / "llama" / "modeling_llama.py"
    os.utime(old, ns=(old.stat().st_atime_ns, old.stat().st_mtime_ns + 10**9))  # same size, new content
    ts._fingerprint.cache_clear()
    ts.scan_once(scanner(calls), folder, None, tmp_path / "cache")
    assert len(calls) == 3


def test_no_usable_cache_scans_as_before(folder, tmp_path):
    calls: list = []
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    for _ in range(2):
        assert ts.scan_once(scanner(calls), folder, None, blocked / "cache")  # cannot be written
        assert ts.scan_once(scanner(calls), folder, None, None)  # off
    assert len(calls) == 4
    cache = tmp_path / "cache"
    ts.scan_once(scanner(calls), folder, None, cache)
    for kept in cache.glob("*.json"):
        kept.write_text("{not json")
    assert ts.scan_once(scanner(calls), folder, None, cache) == ts.scan_once(scanner([]), folder, None, None)
    assert len(calls) == 6


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MILES_IMPORT_CACHE", "off")
    assert ts.cache_dir() is None
    monkeypatch.setenv("MILES_IMPORT_CACHE", str(tmp_path))
    assert ts.cache_dir() == tmp_path
    monkeypatch.delenv("MILES_IMPORT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ts.cache_dir() == tmp_path / "xdg" / "miles" / "transformers"
