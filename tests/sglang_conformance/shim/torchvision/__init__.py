"""Test-only stand-in for torchvision (never installed into the package).

SGLang's HTTP front-end imports torchvision at module level for its image processors. The PyPI torchvision wheel
is built against another torch release and fails on import under our CPU torch ("operator torchvision::nms does
not exist"). The conformance suite serves text-only models, so every name resolves to a placeholder that raises
when it is used; only what SGLang touches at import time has a real value (`InterpolationMode`).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+miles-test-shim"


class _Unavailable:
    """A name SGLang imports but the text-only conformance suite never calls."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchvision.{self._name} is a test shim (tests/sglang_conformance/shim)")

    def __getattr__(self, item: str) -> _Unavailable:
        return _Unavailable(f"{self._name}.{item}")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)
