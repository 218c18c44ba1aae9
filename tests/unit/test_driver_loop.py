"""The synchronous driver loop against a fake system: the order of rollout, train, save, refit, eval and logging
calls for colocated and disaggregated placement, and for the replay-debugging modes (no Ray, no processes)."""

from __future__ import annotations

import pytest

from miles.config import parse_config
from miles.ray.colocate import REFIT_SECONDS, MemoryChoreography, RefitAfterTrain, TrainerOnly
from miles.train import run_loop
from miles.utils.timer import Timer
from miles.utils.types import Sample


class Log(list):
    def __call__(self, *event: object) -> None:
        self.append(event)


class FakeTrainGroup:
    def __init__(self, log: Log) -> None:
        self.log = log

    def train(
        self,
        rollout_id: int,
        per_rank: list[list[Sample]],
        values=None,
        refit: RefitAfterTrain | None = None,
        release: list[str] | None = None,
    ) -> dict[str, float]:
        if release:  # each rank releases the engine it serves, then trains
            self.log("ranks release", tuple(release))
        self.log("train", rollout_id, [len(p) for p in per_rank])
        if refit is None:
            return {"train/loss": 0.5}
        if refit.resume_tags:  # the trainers' rank 0 resumes the engines, then the weights move
            self.log("resume", tuple(refit.resume_tags))
        self.log("refit", refit.weight_version, "in the train call")
        return {"train/loss": 0.5, REFIT_SECONDS: 0.0}

    def save(self, rollout_id: int) -> None:
        self.log("save", rollout_id)

    def save_hf(self, rollout_id: int) -> None:
        self.log("save_hf", rollout_id)

    def update_weights(self, engine_urls: list[str], weight_version: str, flush_cache: bool = True) -> None:
        self.log("refit", weight_version)

    def sleep(self) -> None:
        self.log("trainer sleep")

    def wake_up(self) -> None:
        self.log("trainer wake")


class FakeEngines:
    def __init__(self, log: Log) -> None:
        self.log = log

    def release_memory(self, tags: list[str]) -> None:
        self.log("release", tuple(tags))

    def resume_memory(self, tags: list[str]) -> None:
        self.log("resume", tuple(tags))


class FakeTracker:
    def __init__(self, log: Log) -> None:
        self.log = log

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.log("log", step, sorted(k for k in metrics if not k.startswith(("timing/", "perf/"))))


class FakeSystem:
    """What `run_loop` reads of `miles.ray.system.System` (a `RolloutOnlySystem` without a train group)."""

    def __init__(self, cfg, log: Log, train_group, choreography, start: int = 0) -> None:
        self.cfg, self.log = cfg, log
        self.mode = "train" if train_group is not None else "rollout_only"
        self.train_group, self.choreography = train_group, choreography
        self.critic_group = None
        self.timer, self.start_rollout_id = Timer(), start
        self.tracker = type("T", (), {"log": lambda _, step, m: FakeTracker(log).log_metrics(step, m)})()
        self.progress = type("P", (), {"update": lambda _: None})()

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        self.log("rollout", rollout_id)
        samples = [Sample(index=i, group_index=i // 2, tokens=[1, 2, 3], response_length=1) for i in range(4)]
        return samples, {"rollout/raw_reward": 0.25}

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        self.log("eval", rollout_id)
        return {"eval/x": 1.0}

    def split_by_dp(self, samples: list[Sample]) -> list[list[Sample]]:
        return [samples[:2], samples[2:]]

    def save(self, rollout_id: int) -> None:  # System.save adds the rollout side's state to the checkpoint
        self.train_group.save(rollout_id)


def _cfg(*extra: str):
    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "3", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--colocate"]  # fmt: skip
    return parse_config(base + list(extra))


def _run(
    cfg, colocate: bool, start: int = 0, trainer_offload: bool = True, engines_in_trainers: bool = False
) -> Log:
    log = Log()
    trainer, engines = FakeTrainGroup(log), FakeEngines(log)
    choreo = MemoryChoreography(
        colocate,
        trainer,
        engines,
        ["http://e0"],
        trainer_offload=trainer_offload,
        engines_in_trainers=engines_in_trainers,
    )
    run_loop(cfg, FakeSystem(cfg, log, trainer, choreo, start))
    return log


STEP_LOG = ("log", ["rollout/raw_reward", "train/loss"])


def test_colocated_order():
    cfg = _cfg("--save", "ckpt", "--save-interval", "2")
    log = _run(cfg, colocate=True)
    first = [
        ("rollout", 0), ("release", ("weights", "kv_cache", "cuda_graph")), ("trainer wake"), ("train", 0, [2, 2]),
        ("resume", ("weights",)), ("refit", "1"), ("trainer sleep"), ("resume", ("kv_cache", "cuda_graph")),
    ]  # fmt: skip
    first = [e if isinstance(e, tuple) else (e,) for e in first]
    assert log[: len(first)] == first
    assert log[len(first)] == ("log", 0, STEP_LOG[1])
    # saves every 2 rollouts and after the last, between train and refit
    assert [e for e in log if e[0] == "save"] == [("save", 1), ("save", 2)]
    i = log.index(("save", 1))
    assert log[i - 1] == ("train", 1, [2, 2]) and log[i + 1][0] == "resume"
    assert [e[1] for e in log if e[0] == "log"] == [0, 1, 2]


def test_colocated_on_cpu_skips_the_trainers_sleep_and_wake_and_resumes_once():
    """CPU: sleep/wake move nothing, so they are not called; the engines still release everything before
    training, and the refit resumes every tag in one call before the weights move, both inside the train call."""
    log = _run(_cfg(), colocate=True, trainer_offload=False)
    assert "trainer sleep" not in [e[0] for e in log] and "trainer wake" not in [e[0] for e in log]
    all_tags = ("weights", "kv_cache", "cuda_graph")
    first = [
        ("rollout", 0), ("release", all_tags), ("train", 0, [2, 2]),
        ("resume", all_tags), ("refit", "1", "in the train call"), ("log", 0, STEP_LOG[1]),
    ]  # fmt: skip
    assert log[: len(first)] == first
    assert [e for e in log if e[0] == "refit"] == [("refit", v, "in the train call") for v in "123"]


def test_engines_in_the_ranks_are_released_by_the_ranks_in_the_train_call():
    """Engines served from the training ranks: the driver releases nothing; each rank releases its own engine at
    the start of the train call (also the step whose refit is a call of its own, after a save)."""
    log = _run(
        _cfg("--save", "ckpt", "--save-interval", "2"),
        colocate=True,
        trainer_offload=False,
        engines_in_trainers=True,
    )
    all_tags = ("weights", "kv_cache", "cuda_graph")
    assert "release" not in [e[0] for e in log]
    first = [
        ("rollout", 0), ("ranks release", all_tags), ("train", 0, [2, 2]),
        ("resume", all_tags), ("refit", "1", "in the train call"), ("log", 0, STEP_LOG[1]),
    ]  # fmt: skip
    assert log[: len(first)] == first
    i = log.index(("save", 1))
    assert log[i - 2 : i + 3] == [
        ("ranks release", all_tags), ("train", 1, [2, 2]), ("save", 1), ("resume", all_tags), ("refit", "2")
    ]  # fmt: skip
    assert log.count(("ranks release", all_tags)) == 3


def test_colocated_on_cpu_refits_in_a_call_of_its_own_when_a_save_is_due():
    """A checkpoint goes between training and the refit: the step it is due, the refit is a call of its own
    (resume of every released tag, then the weights); the other steps refit inside the train call."""
    log = _run(_cfg("--save", "ckpt", "--save-interval", "2"), colocate=True, trainer_offload=False)
    i = log.index(("save", 1))
    all_tags = ("weights", "kv_cache", "cuda_graph")
    assert log[i - 1 : i + 3] == [("train", 1, [2, 2]), ("save", 1), ("resume", all_tags), ("refit", "2")]
    assert ("refit", "1", "in the train call") in log and ("refit", "3") in log  # saved after the last too


def test_the_refit_inside_the_train_call_is_timed_as_refit():
    """The train answer's refit seconds move from `timing/train` to `timing/refit`; the key itself is not
    logged."""
    logged: list[dict[str, float]] = []
    log = Log()

    class TimedTrainer(FakeTrainGroup):
        def train(self, rollout_id, per_rank, values=None, refit=None, release=None):
            import time

            time.sleep(0.02)  # longer than the refit seconds it reports (a move is clamped to the phase)
            return {**super().train(rollout_id, per_rank, values, refit, release), REFIT_SECONDS: 0.015}

    trainer = TimedTrainer(log)
    cfg = _cfg()
    system = FakeSystem(
        cfg, log, trainer, MemoryChoreography(True, trainer, FakeEngines(log), ["u"], trainer_offload=False)
    )
    system.tracker = type("T", (), {"log": lambda _, step, m: logged.append(dict(m))})()
    run_loop(cfg, system)
    for m in logged:
        assert REFIT_SECONDS not in m and m["timing/refit"] == pytest.approx(0.015)
        assert m["timing/train"] >= 0.005  # the call slept 0.02 s, 0.015 s of which were the refit's


def test_disaggregated_order_with_eval():
    cfg = _cfg("--eval-prompt-data", "d", "e.jsonl", "--eval-interval", "2")
    log = _run(cfg, colocate=False)
    kinds = [e[0] for e in log]
    # nothing is released or resumed; eval before training, then after rollouts 1 and 2 (the last)
    assert "release" not in kinds and "resume" not in kinds and "trainer sleep" not in kinds
    assert kinds == [
        "eval", "log",
        "rollout", "train", "refit", "log",
        "rollout", "train", "refit", "eval", "log",
        "rollout", "train", "refit", "eval", "log",
    ]  # fmt: skip
    assert [e[1] for e in log if e[0] == "refit"] == ["1", "2", "3"]


def test_resumed_run_starts_at_its_rollout_and_skips_eval_before_training():
    cfg = _cfg("--eval-prompt-data", "d", "e.jsonl", "--eval-interval", "5")
    log = _run(cfg, colocate=False, start=2)
    assert [e for e in log if e[0] in ("rollout", "eval")] == [("rollout", 2), ("eval", 2)]


@pytest.mark.parametrize("mode", ["replay", "rollout_only"])
def test_replay_modes(mode):
    log = Log()
    trainer = FakeTrainGroup(log)
    if mode == "replay":  # --load-debug-rollout-data: no engines, nothing released, resumed or refit
        system = FakeSystem(_cfg(), log, trainer, TrainerOnly())
    else:  # --debug-rollout-only: no trainer
        system = FakeSystem(_cfg(), log, None, None)
    run_loop(system.cfg, system)
    kinds = [e[0] for e in log]
    expected = ["rollout", "train", "log"] if mode == "replay" else ["rollout", "log"]
    assert kinds == expected * 3
