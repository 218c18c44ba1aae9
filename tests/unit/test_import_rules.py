"""Import rules between packages, at module level or inside a function:
- `miles/config` is the floor every package reads: it imports nothing from the packages above it (rollout,
  backends, engines, ray, the drivers);
- the trainer and the engines meet only through the refit wing: `miles/backends` imports nothing from
  `miles/engines` and `miles/engines` nothing from `miles/backends`;
- `miles/refit` (shared by the trainer and the embedded engine) imports neither of them, nor the rollout side,
  Ray set-up or the drivers: a backend hands it the tensors to send."""

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


def forbidden(name: str, packages: tuple[str, ...] = FORBIDDEN) -> bool:
    """`name` is one of `packages` or under one (`miles.train` covers `miles.train_async` too)."""
    return any(name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in packages)


def config_files() -> list[Path]:
    return sorted(CONFIG.rglob("*.py"))


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


# package -> the packages none of its files may import
RULES: dict[str, tuple[str, ...]] = {
    "miles/config": FORBIDDEN,
    "miles/backends": ("miles.engines",),
    "miles/engines": ("miles.backends",),
    "miles/refit": ("miles.backends", "miles.engines", "miles.rollout", "miles.ray", "miles.train"),
}


def _rule_cases() -> list[tuple[Path, tuple[str, ...]]]:
    return [(path, banned) for pkg, banned in RULES.items() for path in sorted((ROOT / pkg).rglob("*.py"))]


@pytest.mark.parametrize(
    ("path", "banned"), _rule_cases(), ids=lambda c: str(c.relative_to(ROOT)) if isinstance(c, Path) else ""
)
def test_package_import_rules(path: Path, banned: tuple[str, ...]) -> None:
    module = "miles." + ".".join(path.relative_to(ROOT / "miles").with_suffix("").parts)
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in imported_modules(path.read_text(), module)
           if forbidden(name, banned)]  # fmt: skip
    assert not bad, f"imports across a package rule ({banned} are off limits):\n" + "\n".join(bad)


def test_the_rules_cover_the_refit_wing_and_both_sides() -> None:
    files = {str(p.relative_to(ROOT)) for p, _ in _rule_cases()}
    assert {
        "miles/refit/refitter.py",
        "miles/engines/local/window.py",
        "miles/backends/fsdp_utils/actor.py",
    } <= files
    names = [n for _, n in imported_modules("from ..local import window", "miles.backends.fsdp_utils.actor")]
    assert not any(forbidden(n, RULES["miles/backends"]) for n in names)  # ..local is miles.backends.local
    names = [
        n for _, n in imported_modules("from ...engines.local import window", "miles.backends.fsdp_utils.x")
    ]
    assert any(forbidden(n, RULES["miles/backends"]) for n in names)


def test_every_config_file_is_checked() -> None:
    names = {p.name for p in config_files()}
    assert {"sections.py", "validate.py", "parser.py", "core.py"} <= names
    assert set(config_files()) <= {p for p, banned in _rule_cases() if banned == FORBIDDEN}
