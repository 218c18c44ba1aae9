"""The training worker's train call with a refit at its end (`RefitAfterTrain`), against a stand-in backend (no
Ray, no process group): the refit runs after training with the released tags to resume, its seconds come back
under `REFIT_SECONDS`, and a failure in it names the phase 'refit', the weight version and the engine, while a
training failure comes back as it was raised."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from miles.ray.colocate import REFIT_SECONDS, MemoryChoreography, RefitAfterTrain
from miles.ray.train_group import RefitAfterTrainError, TrainWorker
from miles.utils.engine_control_http import EngineUnreachable
from miles.utils.types import Sample


class StandInBackend:
    def __init__(self, fail_in: str | None = None) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.fail_in = fail_in

    def train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        self.calls.append(("train", rollout_id, len(samples)))
        if self.fail_in == "train":
            raise ValueError("loss is nan")
        return {"train/loss": 0.25}

    def update_weights(
        self, engine_urls: list[str], weight_version: str, resume_tags: Sequence[str] = ()
    ) -> None:
        self.calls.append(("refit", tuple(engine_urls), weight_version, tuple(resume_tags)))
        if self.fail_in == "refit":
            raise EngineUnreachable(
                "http://e1:2", "resume_memory_occupation", "engine control", "request", "connection refused"
            )


def _worker(backend: StandInBackend) -> TrainWorker:
    worker = object.__new__(TrainWorker)  # the entry point only: no config, no process group
    worker.rank, worker.backend, worker._engine_control = 1, backend, None  # type: ignore[assignment]
    return worker


REFIT = RefitAfterTrain(["http://e0:1", "http://e1:2"], "8", ["weights", "kv_cache"])


def test_refit_runs_after_training_and_reports_its_seconds():
    backend = StandInBackend()
    out = _worker(backend).train(7, [Sample(index=0)], None, REFIT)
    assert backend.calls == [
        ("train", 7, 1),
        ("refit", ("http://e0:1", "http://e1:2"), "8", ("weights", "kv_cache")),
    ]
    assert out["train/loss"] == 0.25 and out[REFIT_SECONDS] >= 0.0


def test_without_a_refit_the_answer_is_trainings_own():
    backend = StandInBackend()
    assert _worker(backend).train(7, [Sample(index=0)]) == {"train/loss": 0.25}
    assert [c[0] for c in backend.calls] == ["train"]


def test_a_failure_in_the_refit_names_the_phase_version_and_engine():
    with pytest.raises(RefitAfterTrainError) as info:
        _worker(StandInBackend(fail_in="refit")).train(7, [Sample(index=0)], None, REFIT)
    message = str(info.value)
    assert "training rank 1: phase 'refit' (weight version 8" in message and "rollout 7" in message
    assert "http://e1:2, resume_memory_occupation" in message
    assert isinstance(info.value.__cause__, EngineUnreachable)


class OwnEngine:
    """The engine a rank serves (`InProcessEngine`): a direct release, refused while busy when `busy`."""

    url = "http://127.0.0.1:9"

    def __init__(self, log: list[tuple[str, list[str]]]) -> None:
        self.log, self.busy = log, False

    def release_memory(self, tags: list[str], timeout: float) -> None:
        from miles.engines.local.control import RefitRefused

        if self.busy:
            raise RefitRefused("release_memory_occupation should be called only when server is idle.")
        self.log.append(("direct", list(tags)))


def test_release_goes_to_the_rank_s_own_engine_before_training(monkeypatch):
    """`release`: the engine this process serves releases the tags, called directly; refused as busy, over
    HTTP (its own URL only, the control kept for the run), which waits for idle; then training runs. A failed
    release raises naming the rank and the tags, and nothing trains. A rank without an engine releases nothing."""
    from types import SimpleNamespace

    import miles.utils.engine_control_http as http

    log: list[tuple[str, list[str]]] = []
    fail = False

    def over_http(self, tags: list[str]) -> None:
        log.append(("http " + ",".join(self.engine_urls), list(tags)))
        if fail:
            raise EngineUnreachable(
                self.engine_urls[0], "release_memory_occupation", "engine control", "request", "x"
            )

    monkeypatch.setattr(http.EngineMemoryControl, "release_memory", over_http)
    backend = StandInBackend()
    worker = _worker(backend)
    engine = OwnEngine(log)
    worker.world_size, worker.engine = 1, engine  # type: ignore[assignment]
    worker.config = SimpleNamespace(  # type: ignore[assignment]
        rollout=SimpleNamespace(rollout_request_timeout=5), engine=SimpleNamespace(engine_api_key=None)
    )
    worker.train(7, [Sample(index=0)], None, REFIT, ["weights", "kv_cache"])
    assert log == [("direct", ["weights", "kv_cache"])]
    assert [c[0] for c in backend.calls] == ["train", "refit"]
    engine.busy = True
    worker.train(8, [Sample(index=0)], None, REFIT, ["weights"])
    control = worker._engine_control  # kept for the run: it asks the engine's kind only once
    assert log[1:] == [("http http://127.0.0.1:9", ["weights"])] and control is not None
    fail = True
    with pytest.raises(
        RuntimeError, match=r"engine release before train failed .* rank 1: EngineUnreachable"
    ):
        worker.train(9, [Sample(index=0)], None, REFIT, ["weights"])
    assert [c[0] for c in backend.calls] == ["train", "refit"] * 2  # nothing trained after the failed release
    assert worker._engine_control is control
    worker.engine = None
    worker.train(10, [Sample(index=0)], None, None, ["weights"])
    assert len(log) == 3 and [c[0] for c in backend.calls] == ["train", "refit"] * 2 + ["train"]


def test_a_training_failure_is_not_reported_as_the_refit():
    backend = StandInBackend(fail_in="train")
    with pytest.raises(ValueError, match="loss is nan"):
        _worker(backend).train(7, [Sample(index=0)], None, REFIT)
    assert [c[0] for c in backend.calls] == ["train"]  # no refit after a failed training


class NoTrainer:
    def update_weights(
        self, engine_urls: list[str], weight_version: str, flush_cache: bool = True
    ) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


class NoEngines:
    def release_memory(self, tags: list[str]) -> None: ...

    def resume_memory(self, tags: list[str]) -> None: ...


@pytest.mark.parametrize(
    ("colocate", "offload", "expected_tags"),
    [
        (True, False, ["weights", "kv_cache", "cuda_graph"]),
        (False, False, []),
        (False, True, []),
        (True, True, None),
    ],
)
def test_which_choreographies_refit_in_the_train_call(colocate, offload, expected_tags):
    """Colocated CPU (everything released: all resumed by the trainers) and disaggregated placement (nothing
    released) refit in the train call; colocated with trainer offload (GPU) needs a refit call of its own."""
    choreo = MemoryChoreography(colocate, NoTrainer(), NoEngines(), ["http://e0:1"], trainer_offload=offload)
    choreo.before_train()
    refit = choreo.refit_with_train("3")
    if expected_tags is None:
        assert refit is None and choreo.released  # the separate refit resumes them
    else:
        assert refit == RefitAfterTrain(["http://e0:1"], "3", expected_tags)
        assert not choreo.released  # the trainers resume them: the next release starts from a clean slate


@pytest.mark.parametrize(
    ("in_trainers", "offload", "critic", "by_ranks"),
    [
        (True, False, False, True),
        (False, False, False, False),
        (True, True, False, False),
        (True, False, True, False),
    ],
)
def test_who_releases_the_engines_before_training(in_trainers, offload, critic, by_ranks):
    """Engines served from the ranks, on CPU, without a critic: `before_train` hands the tags to the train call
    (the ranks release their own engines); otherwise the driver releases them and nothing is handed over."""
    released: list[list[str]] = []

    class Engines(NoEngines):
        def release_memory(self, tags: list[str]) -> None:
            released.append(tags)

    choreo = MemoryChoreography(
        True, NoTrainer(), Engines(), ["http://e0:1"], critic=NoTrainer() if critic else None,
        trainer_offload=offload, engines_in_trainers=in_trainers,
    )  # fmt: skip
    handed = choreo.before_train()
    all_tags = ["weights", "kv_cache", "cuda_graph"]
    assert (handed, released) == (([], [all_tags]) if not by_ranks else (all_tags, []))
    assert choreo.released == set(all_tags)  # resumed by the refit either way
