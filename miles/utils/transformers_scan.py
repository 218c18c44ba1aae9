"""transformers' scan of its model folder, done once per installed version instead of once per process.

`import transformers` reads every file under `transformers/models` for the names each exports: the lazy import
structure (`transformers.utils.import_utils.define_import_structure`), ~0.28 s of CPU in every process that
imports transformers (each training rank, the rollout manager), with the same answer each time for the same files.
Importing `transformers.models` (the package of any model class) asks for the same folder again by its
`__init__.py`, which transformers' own cache keys apart from the folder: another 0.28 s in each training rank.

`install()` (before transformers is imported; it does nothing where transformers is absent) wraps that function as
its module is loaded, or at once if it is loaded already:
- a file stands for its folder (transformers' own rule), so the second request is the first one's;
- the answer for the model folder is kept in a JSON file (`$MILES_IMPORT_CACHE`, else
  `$XDG_CACHE_HOME/miles/transformers` or `~/.cache/miles/transformers`; `MILES_IMPORT_CACHE=off` keeps none),
  valid while every file and folder under it has the path, size and modification time it had when it was written
  (~20 ms to check). A cache that cannot be read or written is ignored: transformers scans as before.
The answers are transformers' own, so what the lazy modules hold is the same with or without this.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TARGET = "transformers.utils.import_utils"
FORMAT = 1  # of the cache file; part of the fingerprint
CACHE_ENV = "MILES_IMPORT_CACHE"

Structure = dict[frozenset[str], dict[str, set[str]]]
Scan = Callable[..., Any]


def install() -> None:
    """Make transformers' import-structure scans go through `scan_once` (see the module doc); idempotent."""
    module = sys.modules.get(TARGET)
    if module is not None:
        _patch(module)
    elif importlib.util.find_spec("transformers") is not None and not any(
        isinstance(f, _Finder) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _Finder())


def cache_dir() -> Path | None:
    """Where the scans are kept; None when `$MILES_IMPORT_CACHE` is `off`."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return None if chosen.lower() == "off" else Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "miles" / "transformers"


def scan_once(scan: Scan, folder: Path, prefix: str | None, cache: Path | None) -> Any:
    """`scan(folder, prefix)`, from `cache` when it holds it for the folder's files as they are now, else scanned
    and kept there (when it survives a round trip through JSON exactly)."""
    if cache is None:
        return scan(folder, prefix)
    fingerprint = _fingerprint(folder)
    key = hashlib.sha256(f"{folder.resolve()}\0{prefix}".encode()).hexdigest()[:16]
    path = cache / f"import_structure_{key}.json"
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
        if kept["fingerprint"] == fingerprint:
            return _decode(kept["structure"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    structure = scan(folder, prefix)
    try:
        encoded = _encode(structure)
        if _decode(encoded) == structure:
            _write(path, {"fingerprint": fingerprint, "structure": encoded})
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return structure


@functools.lru_cache(maxsize=8)  # transformers asks for its model folder twice (with and without a prefix)
def _fingerprint(folder: Path) -> str:
    """Path, size and modification time of everything under `folder` (bytecode caches aside), as this process
    first saw them."""
    lines: list[str] = [f"format {FORMAT}"]

    def walk(directory: str) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name == "__pycache__":
                    continue
                st = entry.stat(follow_symlinks=False)
                lines.append(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}")
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path)

    walk(str(folder))
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()


def _encode(structure: Structure) -> list[list[Any]]:
    return [
        [sorted(backends), {module: sorted(names) for module, names in modules.items()}]
        for backends, modules in structure.items()
    ]


def _decode(encoded: Sequence[Sequence[Any]]) -> Structure:
    return {
        frozenset(backends): {module: set(names) for module, names in modules.items()}
        for backends, modules in encoded
    }


def _write(path: Path, data: object) -> None:
    """Write atomically (processes starting together may write the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _patch(module: types.ModuleType) -> None:
    """Wrap `module.define_import_structure` (transformers' import_utils), once."""
    scan = getattr(module, "define_import_structure", None)
    if scan is None or getattr(scan, "miles_scan_once", False):
        return
    models = Path(module.__file__ or "").resolve().parent.parent / "models"

    @functools.cache  # as transformers' own: one answer per argument
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        path = Path(module_path)
        folder = path.parent if path.is_file() else path
        if folder.resolve() != models:  # a model's own package: a small folder, scanned as before
            return scan(folder, prefix)
        return scan_once(scan, folder, prefix, cache_dir())

    define_import_structure.miles_scan_once = True  # type: ignore[attr-defined]
    module.define_import_structure = define_import_structure  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers' import_utils as the path finder does, with a loader that patches it once loaded."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one module, once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and isinstance(spec.loader, importlib.abc.Loader):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader  # the module looks as the path finder would have loaded it
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _patch(module)
