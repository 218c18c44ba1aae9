"""Shim of torchvision.transforms (see the package docstring)."""

from __future__ import annotations

import enum
from typing import Any

from torchvision import _Unavailable


class InterpolationMode(enum.Enum):
    """The values torchvision defines; SGLang reads them at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"transforms.{name}")
