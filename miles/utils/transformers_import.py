"""Import transformers' model code with less start-up work in each process that builds a model (each training rank).

Inside `lean_transformers()`:
- `scipy.optimize` is a stand-in (`miles.utils.lazy_import`): `transformers.modeling_utils` imports its loss
  registry, whose object-detection losses (DETR, Deformable DETR, Grounding DINO) run
  `from scipy.optimize import linear_sum_assignment` when scipy is installed (~0.5 s of CPU), for a function only
  those losses call; it imports the real module when called, any other attribute at once.
- `trio` is a stand-in: the HTTP client of `transformers.utils.hub` (httpcore) imports it at module level to serve
  trio programs (~0.07 s of CPU); it is used only when code runs under trio's event loop, which miles never does.
- transformers scans the folder of its model code (~0.28 s of CPU) once per installed version, not twice per
  process (`miles.utils.transformers_scan`: installed here, it stays for the process);
- no cyclic garbage collection runs, and what was imported is frozen out of later collections at the end
  (`miles.utils.lazy_import.gc_paused`; ~1 s of CPU in a training rank, whose first import of torch is the
  backend's, inside this block). Only the first block of a process does any of this: later ones find
  transformers' model code imported.
The stand-ins leave `sys.modules` when the block ends, so a later import is the real module. Nothing changes where
scipy or trio is not installed, or for what is imported already.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from miles.utils.lazy_import import deferred, gc_paused
from miles.utils.transformers_scan import install as install_scan_once

OPTIMIZE = "scipy.optimize"
# modules transformers' model code imports at start-up and a training rank does not use: name -> deferred functions
STAND_INS = {OPTIMIZE: ("linear_sum_assignment",), "trio": ()}


@contextlib.contextmanager
def lean_transformers() -> Iterator[None]:
    """Imports of transformers' model code inside this block do less work (see the module doc)."""
    if "transformers.modeling_utils" in sys.modules:
        yield
        return
    install_scan_once()
    with deferred(STAND_INS), gc_paused(freeze=True):
        yield
