"""The backend contract's two roles (miles/backends/base.py): the registry hands out a `PolicyBackend` for the
actor and a `ValueBackend` for the critic, neither built on the other, and the training worker routes each role's
train call to its own method."""

from __future__ import annotations

import pytest

import miles.backends
from miles.backends import get_policy_class, get_value_class
from miles.backends.base import PolicyBackend, ValueBackend, ValueTrainResult
from miles.ray.train_group import TrainWorker
from miles.utils.types import Sample


def test_fsdp_roles_are_separate_classes_of_their_protocols():
    policy, value = get_policy_class("fsdp"), get_value_class("fsdp")
    assert issubclass(policy, PolicyBackend) and not issubclass(policy, ValueBackend)
    assert issubclass(value, ValueBackend) and not issubclass(value, PolicyBackend)
    # composed, not inherited: neither role switches the other's methods off
    assert not issubclass(value, policy) and not issubclass(policy, value)
    assert not hasattr(value, "update_weights") and not hasattr(value, "save_hf")


def test_a_registered_class_of_the_wrong_protocol_is_refused(monkeypatch):
    monkeypatch.setitem(
        miles.backends._BACKENDS,
        "swapped",
        {
            "actor": "miles.backends.fsdp_utils.critic:FSDPCritic",
            "critic": "miles.backends.fsdp_utils.actor:FSDPTrainer",
        },
    )
    with pytest.raises(TypeError, match="'swapped': the actor FSDPCritic is not a PolicyBackend"):
        get_policy_class("swapped")
    with pytest.raises(TypeError, match="'swapped': the critic FSDPTrainer is not a ValueBackend"):
        get_value_class("swapped")


class StandInValue(ValueBackend):
    def __init__(self) -> None:
        pass

    def init(self, role: str, with_ref: bool) -> int:
        return 0

    def train(self, rollout_id: int, samples: list[Sample]) -> ValueTrainResult:
        return {"metrics": {"critic/value_loss": 0.5}, "values": [[0.0] * s.response_length for s in samples]}

    def save(self, rollout_id, extra_state=None) -> None:  # noqa: ANN001
        pass

    def resume_state(self) -> dict:
        return {}

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


def _worker(backend: object) -> TrainWorker:
    worker = object.__new__(TrainWorker)  # the entry point only: no config, no process group
    worker.rank, worker.backend = 0, backend  # type: ignore[assignment]
    return worker


def test_the_worker_routes_the_critic_to_train_values():
    worker = _worker(StandInValue())
    out = worker.train_values(3, [Sample(index=0, response_length=2)])
    assert out == {"metrics": {"critic/value_loss": 0.5}, "values": [[0.0, 0.0]]}
    with pytest.raises(RuntimeError, match="the critic role trains with train_values"):
        worker.train(3, [Sample(index=0)])
    with pytest.raises(RuntimeError, match="rank 0: called before init"):
        _worker(None).train_values(3, [])
