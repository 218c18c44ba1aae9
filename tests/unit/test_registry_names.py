"""The choices `miles.config` lists as constants equal their registries (the config may not import them)."""

from __future__ import annotations

import pytest

from miles.config.registry_names import ROUTER_POLICIES, TRAIN_BACKENDS


def test_train_backends_are_the_registered_ones() -> None:
    from miles.backends import available_backends

    assert tuple(sorted(TRAIN_BACKENDS)) == tuple(available_backends())


def test_router_policies_are_sglang_routers_own() -> None:
    pytest.importorskip("sglang_router")
    from miles.engines.router_args import router_policies

    assert ROUTER_POLICIES == router_policies()
