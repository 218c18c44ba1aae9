"""Shim submodule of torchvision (see the package docstring)."""

from __future__ import annotations

from typing import Any

from torchvision import _Unavailable
from torchvision.transforms import InterpolationMode  # noqa: F401 - re-exported as in torchvision


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"{__name__.removeprefix('torchvision.')}.{name}")
