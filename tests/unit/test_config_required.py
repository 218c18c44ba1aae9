"""`miles.config.required`: the value of a flag declared required, or the ConfigError a validated config
would have raised (for configs built directly, as tests do)."""

from __future__ import annotations

import pytest

from miles.config import Config, ConfigError, RolloutConfig, required


@pytest.mark.parametrize("value", [0, 0.0, "", [], 7, "x"])
def test_a_set_value_comes_back_as_is_even_when_falsy(value):
    assert required(value, "--flag") is value


def test_none_raises_config_error_naming_the_flag():
    with pytest.raises(ConfigError, match="--rollout-batch-size is required"):
        required(None, "--rollout-batch-size")


def test_a_directly_built_config_without_a_required_flag_fails_at_its_use_site():
    from miles.rollout.runner import RolloutRunner

    cfg = Config(rollout=RolloutConfig(rollout_batch_size=None))
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        RolloutRunner.set_start_rollout(_Stub(cfg.rollout), 3)


class _Stub:
    """Just what `set_start_rollout` reads before it needs the data."""

    def __init__(self, rollout_cfg: RolloutConfig) -> None:
        self.rollout_cfg = rollout_cfg
