"""The trainer's plan for a rollout whose sample count varies (issue 26, --use-session-server: a group holds every
picked leaf of its sessions): the rank's samples cut into the configured number of optimizer steps, micro-batch
counts agreed across DP ranks."""

from __future__ import annotations

import pytest

from miles.backends.fsdp_utils.data_packing import plan_variable_micro_batches


@pytest.mark.parametrize(
    ("n", "steps", "mbs", "others", "want"),
    [
        (6, 1, 4, [2, -9], [[[0, 1, 2], [3, 4, 5]]]),  # 2 micro-batches of 3: what this rank needs
        (5, 1, 4, [3, -9], [[[0, 1], [2, 3], [4]]]),  # another rank needs 3: this one splits into 3 too
        (7, 2, 2, [2, -9, 2, -9], [[[0, 1], [2, 3]], [[4, 5], [6]]]),  # 4 + 3 samples in the two steps
    ],
)
def test_variable_plan_cuts_what_the_rank_got(n, steps, mbs, others, want) -> None:
    agreed = iter(others)
    plan = plan_variable_micro_batches(
        [10] * n, num_steps=steps, use_dynamic=False, max_tokens_per_gpu=None, micro_batch_size=mbs,
        allreduce_max=lambda local: max(local, next(agreed)),
    )  # fmt: skip
    assert plan == want
    assert sorted(i for step in plan for mb in step for i in mb) == list(range(n))


def test_variable_plan_refuses_too_few_samples() -> None:
    with pytest.raises(ValueError, match="cannot fill num_steps=3"):
        plan_variable_micro_batches(
            [4, 4], num_steps=3, use_dynamic=False, max_tokens_per_gpu=None, micro_batch_size=1
        )
    # another rank needs 3 micro-batches (3 samples, micro-batch size 1) but this one has 2: both run 2
    replies = iter([3, -2])
    plan = plan_variable_micro_batches(
        [4, 4], num_steps=1, use_dynamic=False, max_tokens_per_gpu=None, micro_batch_size=1,
        allreduce_max=lambda local: max(local, next(replies)),
    )  # fmt: skip
    assert plan == [[[0], [1]]]
    dyn = plan_variable_micro_batches(
        [4, 4, 4], num_steps=1, use_dynamic=True, max_tokens_per_gpu=8, micro_batch_size=None
    )
    assert sorted(len(mb) for mb in dyn[0]) == [1, 2]


def test_session_extras_take_their_episode_reward() -> None:
    """With a reward function (the agent returned None) only each episode's own sample is scored; its extra
    leaves, right after it, take that reward."""
    from miles.rollout.default_rollout import share_session_rewards
    from miles.utils.types import Sample

    def s(reward: float | None, extra: bool) -> Sample:
        return Sample(reward=reward, metadata={"session_extra": True} if extra else {})

    group = [
        s(0.5, False),
        s(None, True),
        s(1.0, False),
        s({"acc": 0.0}, False),
        s(None, True),
        s(None, True),
    ]
    share_session_rewards(group)
    assert [x.reward for x in group] == [0.5, 0.5, 1.0, {"acc": 0.0}, {"acc": 0.0}, {"acc": 0.0}]
    assert group[4].reward is not group[3].reward  # a copy: post-processing one leaf's dict leaves the others
