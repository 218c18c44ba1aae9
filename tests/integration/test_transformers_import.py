"""`miles.utils.transformers_import.lean_transformers`: transformers' model code imported without scipy.optimize,
whose one function it uses still works (imported when called), and the real module afterwards."""

from __future__ import annotations

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


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_model_code_imports_without_scipy_until_its_one_function_is_called():
    out = run(CHECK).splitlines()
    assert out[:2] == ["scipy=False", "stand_in_left=False"], out
    assert "assignment=[[0, 1, 2], [1, 0, 2]]" in out
    assert "real=True" in out


def test_any_other_name_is_the_real_modules():
    assert run(FORWARD).splitlines() == ["linprog=True"]
