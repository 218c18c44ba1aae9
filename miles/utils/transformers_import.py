"""Import transformers' model code without `scipy.optimize`.

`transformers.modeling_utils` imports its loss registry, whose object-detection losses (DETR, Deformable DETR,
Grounding DINO) run `from scipy.optimize import linear_sum_assignment` when scipy is installed: ~0.5 s of CPU in
every process that builds a model (each training rank), for a function only those models' losses call. Inside
`lean_transformers()` the name `scipy.optimize` stands for a small module whose `linear_sum_assignment` imports the
real one when first called, so those losses still work; any other attribute of it imports the real module at
once. The stand-in leaves `sys.modules` when the block ends, so a later `import scipy.optimize` is the real one.
Nothing changes where scipy is not installed, or where transformers' model code or `scipy.optimize` is imported
already.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

OPTIMIZE = "scipy.optimize"


@contextlib.contextmanager
def lean_transformers() -> Iterator[None]:
    """Imports inside this block see `scipy.optimize` as a stand-in that loads the real module on first use."""
    if (
        "transformers.modeling_utils" in sys.modules
        or OPTIMIZE in sys.modules
        or importlib.util.find_spec("scipy") is None
    ):
        yield
        return
    stand_in = _LazyOptimize(OPTIMIZE)
    sys.modules[OPTIMIZE] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(OPTIMIZE) is stand_in:
            del sys.modules[OPTIMIZE]


def linear_sum_assignment(*args: Any, **kwargs: Any) -> Any:
    """`scipy.optimize.linear_sum_assignment`, imported when called."""
    return _real().linear_sum_assignment(*args, **kwargs)


def _real() -> types.ModuleType:
    module = sys.modules.get(OPTIMIZE)
    if isinstance(module, _LazyOptimize):  # still inside the block: the real module replaces the stand-in
        del sys.modules[OPTIMIZE]
    return importlib.import_module(OPTIMIZE)


class _LazyOptimize(types.ModuleType):
    """Stands in for `scipy.optimize` (see the module doc)."""

    linear_sum_assignment = staticmethod(linear_sum_assignment)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what the import system probes (__path__, ...): a plain module has none
            raise AttributeError(name)
        return getattr(_real(), name)
