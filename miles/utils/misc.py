"""Small helpers shared across the package."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


# the signature of a user function imported by path is unknown until it is checked at its call site: Any is honest
def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import `module.path:function` (or dotted `module.path.function`) named by the user flag `flag`.

    Raises ValueError naming the flag and the path when the module or attribute cannot be imported.
    """
    if not path:
        raise ValueError(f"{flag}: empty function path")
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag}={path!r}: expected 'module.path:function' or 'module.path.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - report any import-time failure with the flag name
        raise ValueError(
            f"{flag}={path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    try:
        fn = getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"{flag}={path!r}: module {module_name!r} has no attribute {attr!r}") from e
    if not callable(fn):
        raise ValueError(f"{flag}={path!r}: {attr!r} is not callable")
    return fn
