"""Import transformers' model code with less start-up work in each process that builds a model (each training rank).

Inside `lean_transformers()`:
- `scipy.optimize` is a stand-in (`miles.utils.lazy_import`): `transformers.modeling_utils` imports its loss
  registry, whose object-detection losses (DETR, Deformable DETR, Grounding DINO) run
  `from scipy.optimize import linear_sum_assignment` when scipy is installed (~0.5 s of CPU), for a function only
  those losses call; it imports the real module when called, any other attribute at once.
- `trio` is a stand-in: the HTTP client of `transformers.utils.hub` (httpcore) imports it at module level to serve
  trio programs (~0.07 s of CPU); it is used only when code runs under trio's event loop, which miles never does.
- transformers scans the folder of its model code once, not twice: `import transformers` reads every file under
  `transformers/models` for the names each exports (its lazy import structure, ~0.28 s of CPU), and importing
  `transformers.models` (the package of any model class) asks for the same folder again by its `__init__.py`,
  which transformers' cache keys apart; inside the block that second request is made by the folder's path, which
  its cache answers. The answer is the same by transformers' own rule (a file stands for its folder).
The stand-ins leave `sys.modules` when the block ends, so a later import is the real module. Nothing changes where
scipy or trio is not installed, or for what is imported already.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles.utils.lazy_import import deferred

OPTIMIZE = "scipy.optimize"
# modules transformers' model code imports at start-up and a training rank does not use: name -> deferred functions
STAND_INS = {OPTIMIZE: ("linear_sum_assignment",), "trio": ()}


@contextlib.contextmanager
def lean_transformers() -> Iterator[None]:
    """Imports of transformers' model code inside this block do less work (see the module doc)."""
    if "transformers.modeling_utils" in sys.modules:
        yield
        return
    with deferred(STAND_INS), _one_model_scan():
        yield


@contextlib.contextmanager
def _one_model_scan() -> Iterator[None]:
    """Inside this block, transformers' scan of a package given by its `__init__.py` file is asked for by the
    package's folder, as `import transformers` asked for `transformers/models`, so its cache answers it."""
    if "transformers.models" in sys.modules:
        yield
        return
    import transformers  # noqa: F401  - scans transformers/models (once)
    from transformers.utils import import_utils

    scan = import_utils.define_import_structure

    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        path = Path(module_path)
        return scan(path.parent if path.is_file() else path, prefix)

    import_utils.define_import_structure = define_import_structure
    try:
        yield
    finally:
        if import_utils.define_import_structure is define_import_structure:
            import_utils.define_import_structure = scan
