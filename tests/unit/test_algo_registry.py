"""Registry semantics shared by every algorithm variant, and the layer rule of miles/algo."""

import pathlib
import re

import pytest

from miles.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, REDUCTIONS, Registry


def test_register_get_names():
    reg: Registry[object] = Registry("widget")

    @reg.register("b")
    def b():
        return 2

    reg.add("a", 1)
    assert reg.get("b") is b
    assert reg.get("a") == 1
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg
    assert len(reg) == 2


def test_duplicate_rejected():
    reg: Registry[int] = Registry("widget")
    reg.add("x", 1)
    with pytest.raises(ValueError, match="widget 'x' is already registered"):
        reg.add("x", 2)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x")
    assert reg.get("x") == 1


def test_miss_lists_choices():
    reg: Registry[int] = Registry("widget")
    reg.add("alpha", 1)
    reg.add("beta", 2)
    with pytest.raises(ValueError, match=r"unknown widget 'gamma'; choose one of \['alpha', 'beta'\]"):
        reg.get("gamma")


def test_empty_name_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        Registry("widget").register("")


def test_builtin_variants_registered():
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {
        "grpo",
        "gspo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "rloo",
    }
    assert set(POLICY_LOSSES.names()) >= {"ppo", "gspo"}
    assert set(REDUCTIONS.names()) == {"sample_mean", "token_mean", "constant_sum"}


def test_algo_layer_imports_nothing_forbidden():
    root = pathlib.Path(__file__).resolve().parents[2] / "miles" / "algo"
    forbidden = re.compile(
        r"^\s*(from|import)\s+(ray\b|torch\.distributed|miles\.(config|backends|rollout|ray)\b)", re.M
    )
    files = sorted(root.glob("*.py"))
    assert files
    for path in files:
        assert not forbidden.search(path.read_text()), f"{path.name} imports a forbidden layer"
