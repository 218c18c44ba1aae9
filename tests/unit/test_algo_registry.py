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


def test_cli_choices_are_the_registered_variants():
    """The torch-free names the CLI offers (miles/config/algo_names.py) are exactly what miles.algo registers."""
    from miles.algo import KL_TYPES, MIS_LEVELS
    from miles.config import algo_names
    from miles.config.schema import FIELDS
    from miles.config.sections import AlgoConfig

    assert sorted(algo_names.ADVANTAGE_ESTIMATORS) == ADVANTAGE_ESTIMATORS.names()
    assert sorted(algo_names.POLICY_LOSSES) == POLICY_LOSSES.names()
    assert sorted(algo_names.LOSS_REDUCTIONS) == REDUCTIONS.names()
    assert sorted(algo_names.KL_TYPES) == sorted(KL_TYPES)
    assert sorted(algo_names.MIS_LEVELS) == sorted(MIS_LEVELS)
    for name, names in (
        ("advantage_estimator", algo_names.ADVANTAGE_ESTIMATORS),
        ("policy_loss", algo_names.POLICY_LOSSES),
        ("loss_reduction", algo_names.LOSS_REDUCTIONS),
        ("kl_loss_type", algo_names.KL_TYPES),
        ("mis_level", algo_names.MIS_LEVELS),
    ):
        assert set(FIELDS[name].choices or ()) == set(names), name
    assert (
        AlgoConfig.__dataclass_fields__["policy_loss"].default is None
    )  # None: algo_names.default_policy_loss
