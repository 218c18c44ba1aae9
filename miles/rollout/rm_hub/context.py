"""`RewardContext`: the settings a reward function may read (instead of the whole configuration)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardContext:
    """What a reward function gets besides the sample(s).

    Built once per run from the rollout flags. A reward function ported from slime/miles reads these fields
    instead of `args.<flag>` (see the README, "Porting a reward function").
    """

    rm_type: str | None = None  # --rm-type (a sample's metadata["rm_type"] overrides it for that sample)
    reward_key: str | None = None  # --reward-key: the trained key of a dict reward
    rm_url: str | None = None  # --rm-url: a remote reward service
    rm_timeout: float = 60.0  # --rm-timeout: seconds per remote reward request
    rm_max_retries: int = 3  # --rm-max-retries: retries of a failed remote reward request
    max_response_len: int | None = None  # --rollout-max-response-len
    n_samples_per_prompt: int = 1  # --n-samples-per-prompt
    evaluation: bool = False  # scoring an eval set
