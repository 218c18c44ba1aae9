"""Import rules between packages: `miles/config` is the floor every package reads, so it imports nothing from
the packages above it (rollout, backends, engines, ray, the drivers), at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "miles" / "config"
FORBIDDEN = ("miles.rollout", "miles.backends", "miles.engines", "miles.ray", "miles.train")


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source` (the file of `module`), function-level and relative ones
    included; `from miles import x` counts as `miles.x`."""
    found = []
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


def forbidden(name: str) -> bool:
    """`miles.train`, `miles.train_async` and anything under the forbidden packages."""
    return any(name == f or name.startswith(f + ".") or name.startswith(f + "_") for f in FORBIDDEN)


def config_files() -> list[Path]:
    return sorted(CONFIG.rglob("*.py"))


@pytest.mark.parametrize("path", config_files(), ids=lambda p: p.name)
def test_config_imports_nothing_from_above(path: Path) -> None:
    module = "miles." + ".".join(path.relative_to(ROOT / "miles").with_suffix("").parts)
    bad = [f"{path.name}:{line}: {name}" for line, name in imported_modules(path.read_text(), module)
           if forbidden(name)]  # fmt: skip
    assert not bad, "miles/config imports from packages above it:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "from miles.backends import available_backends",
        "def f():\n    from miles.engines.router_args import router_policies\n",
        "import miles.rollout.runner",
        "from miles import ray",
        "from miles.train import main",
        "from miles.train_async import main",
        "from ..engines import external",
        "class C:\n    def m(self):\n        import miles.ray.setup as s\n",
    ],
)
def test_the_check_finds_each_kind_of_import(source: str) -> None:
    names = [name for _, name in imported_modules(source, "miles.config.sections")]
    assert any(forbidden(n) for n in names), names


@pytest.mark.parametrize(
    "source",
    [
        "from miles.config.schema import FIELDS",
        "import miles.utils.net",
        "from . import algo_names",
        "import os",
    ],
)
def test_imports_of_the_floor_pass(source: str) -> None:
    names = [name for _, name in imported_modules(source, "miles.config.sections")]
    assert not any(forbidden(n) for n in names), names


def test_every_config_file_is_checked() -> None:
    names = {p.name for p in config_files()}
    assert {"sections.py", "validate.py", "parser.py", "core.py"} <= names
