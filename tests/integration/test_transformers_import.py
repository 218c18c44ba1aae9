"""`miles.utils.transformers_import.lean_transformers`: transformers' model code imported without scipy.optimize,
whose one function it uses still works (imported when called), and the real module afterwards; without trio (httpcore
keeps a stand-in that forwards to it); and with one scan of transformers' model folder, not two."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("scipy")

CHECK = """
import sys
from miles.utils.transformers_import import lean_transformers
with lean_transformers():
    import transformers.modeling_utils
print("scipy=%s" % ("scipy" in sys.modules))
print("stand_in_left=%s" % ("scipy.optimize" in sys.modules))
from transformers.loss import loss_for_object_detection as detection
print("assignment=%s" % [a.tolist() for a in detection.linear_sum_assignment([[4, 1, 3], [2, 0, 5], [3, 2, 2]])])
import scipy.optimize
print("real=%s" % (scipy.optimize.linear_sum_assignment.__module__ == "scipy.optimize._lsap"))
"""

# a stand-in still in place (an import inside the block) hands out the real module's other names
FORWARD = """
from miles.utils.transformers_import import lean_transformers
with lean_transformers():
    from scipy.optimize import linprog
import scipy.optimize
print("linprog=%s" % (linprog is scipy.optimize.linprog))
"""


def run(code: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout


def test_model_code_imports_without_scipy_until_its_one_function_is_called():
    out = run(CHECK).splitlines()
    assert out[:2] == ["scipy=False", "stand_in_left=False"], out
    assert "assignment=[[0, 1, 2], [1, 0, 2]]" in out
    assert "real=True" in out


def test_any_other_name_is_the_real_modules():
    assert run(FORWARD).splitlines() == ["linprog=True"]


# as a training rank imports its backend: the attention registry, then the model's package (without the block,
# transformers scans its model folder twice here and imports trio)
SCANS = """
import os, sys
import importlib.util
models = os.path.join(os.path.dirname(importlib.util.find_spec("transformers").origin), "models")
scans = []
sys.addaudithook(lambda event, args: scans.append(1) if event == "os.scandir" and str(args[0]) == models else None)
from miles.utils.transformers_import import lean_transformers
with lean_transformers():
    from transformers import AttentionInterface
    import transformers.models.qwen3.modeling_qwen3
print("scans=%d" % len(scans))
print("trio=%s" % ("trio" in sys.modules))
sync = [m for name, m in sys.modules.items() if name.startswith("httpcore") and name.endswith("_synchronization")]
import trio
print("forwards=%s" % (len(sync) > 0 and all(m.trio.Lock is trio.Lock for m in sync)))
import transformers, transformers.models
print("classes=%d" % len(transformers.models._class_to_module))
import gc
print("gc=%s" % gc.isenabled())
print("frozen=%s" % (gc.get_freeze_count() > 100_000))  # what the imports made: out of later collections
"""


def test_model_folder_is_scanned_once_then_kept_and_trio_is_a_stand_in(tmp_path):
    pytest.importorskip("trio")
    env = {**os.environ, "MILES_IMPORT_CACHE": str(tmp_path)}
    cold = run(SCANS, env).splitlines()
    # one scan, and one walk of the folder for its fingerprint; kept; then the walk only: the folder is as it was
    assert cold[:3] == ["scans=2", "trio=False", "forwards=True"], cold
    # as transformers and transformers.models ask for it
    assert len(list(tmp_path.glob("import_structure_*.json"))) == 2
    warm = run(SCANS, env).splitlines()
    assert warm[0] == "scans=1", warm
    assert warm[3] == cold[3] and int(cold[3].split("=")[1]) > 100
    assert warm[4:] == ["gc=True", "frozen=True"], warm
