"""Records passed between the rollout side and the trainer.

Token ids are the only currency between rollout and trainer: nothing is re-tokenized on the training side.
`Sample` objects travel as they are from generation to the trainer's batch (Ray pickles dataclasses).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import numpy as np

# a value as JSON reads it (dataset rows, labels, metadata, HTTP bodies); narrow it with isinstance before use
JSON: TypeAlias = "dict[str, JSON] | list[JSON] | str | int | float | bool | None"

# a Ray actor handle (ray.actor.ActorHandle); its `.method.remote(...)` attributes are made at run time, so
# no checker can see them: Any is the honest type
ActorHandle: TypeAlias = Any


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # the engine stopped on EOS or a stop string/token (or the model answered)
    TRUNCATED = "truncated"  # hit max_new_tokens, the context budget or the turn limit
    ABORTED = "aborted"  # the request was aborted (partial rollout, pause for refit)
    FAILED = "failed"  # reward or generation failed; the sample carries no learning signal


@dataclass
class Sample:
    """One prompt + one response (possibly several model turns with tool output between), as generated and scored.

    `tokens` is prompt ids followed by response ids; `response_length` counts the trailing response ids.
    `loss_mask` and `rollout_log_probs` are per response token (length `response_length`): the mask is 1 on
    model tokens that are trained on and 0 on tool output (and on masked-out segments); log-probs are the
    engine's for model tokens and 0.0 for tokens the model did not sample. `weight_versions` has one entry
    per generated segment (a turn, or the continuation of an aborted partial response), in order.
    """

    index: int = 0  # position in the rollout batch
    group_index: int = 0  # which prompt group (the n samples of one prompt share it)
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)  # [prompt_len + response_length]
    response_length: int = 0
    response: str = ""
    label: JSON = None  # as the dataset row holds it
    reward: float | dict[str, float] | None = None  # as the reward function returned it
    train_reward: float | None = (
        None  # the scalar trained on (--reward-key, post-processing); see scalar_reward
    )
    loss_mask: list[int] | None = None  # [response_length]
    rollout_log_probs: list[float] | None = None  # [response_length]
    weight_versions: list[str] = field(default_factory=list)
    # R3 (--use-rollout-routing-replay): the engine's experts per token, SGLang's rows (miles.utils.routed_experts)
    rollout_routed_experts: np.ndarray | None = None  # [<= len(tokens) - 1, num_layers * top_k] uint8/int16
    status: SampleStatus = SampleStatus.PENDING
    # the dataset row's metadata plus what rollout functions record (JSON-able); their own keys, read back
    # by the code that wrote them, so typed per use, not here
    metadata: dict[str, Any] = field(default_factory=dict)
    # VLM (--multimodal-keys): the prompt's images by modality, {"image": ["data:image/png;base64,...", ...]}, in
    # the order of their pad tokens in `tokens` (the processor's expanded prompt ids); the engine gets them as
    # SGLang's `image_data`, the trainer re-processes them with the checkpoint's image processor
    multimodal_data: dict[str, list[str]] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    @property
    def is_finished(self) -> bool:
        """Generation is over for this sample (nothing to continue)."""
        return self.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED)

    def append_tokens(self, ids: list[int], log_probs: list[float] | None, trainable: bool) -> None:
        """Append response tokens: model tokens (`trainable`, with their log-probs) or tool/env tokens (mask 0)."""
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"sample {self.index}: {len(ids)} token ids but {len(log_probs)} log-probs")
        had_log_probs = self.rollout_log_probs is not None or self.response_length == 0
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        self.tokens.extend(int(t) for t in ids)
        self.loss_mask.extend([1 if trainable else 0] * len(ids))
        if trainable and log_probs is None:
            self.rollout_log_probs = None  # the engine gave none for model tokens: nothing to compare with
        elif had_log_probs:
            previous = self.rollout_log_probs or []
            self.rollout_log_probs = previous + (
                [float(x) for x in log_probs] if log_probs else [0.0] * len(ids)
            )
        self.response_length += len(ids)

    def check_consistent(self) -> str | None:
        """What is wrong with this sample's lengths (None when token ids, loss mask and log-probs agree)."""
        if not 0 <= self.response_length <= len(self.tokens):
            return f"response_length {self.response_length} with {len(self.tokens)} token ids"
        if self.response_length == len(self.tokens) and self.tokens:
            return "no prompt tokens (at least one is needed to predict the first response token)"
        for name, values in (("loss_mask", self.loss_mask), ("rollout_log_probs", self.rollout_log_probs)):
            if values is not None and len(values) != self.response_length:
                return f"{name} has {len(values)} entries but response_length is {self.response_length}"
        return None

    def reward_value(self, reward_key: str | None) -> float:
        """The scalar of `reward`: the number itself, or `reward[reward_key]` for a dict reward."""
        reward = self.reward
        if isinstance(reward, dict):
            if reward_key is None:
                raise ValueError(
                    f"sample {self.index}: the reward is a dict with keys {sorted(reward)}; "
                    "set --reward-key to pick the trained one"
                )
            if reward_key not in reward:
                raise ValueError(
                    f"sample {self.index}: --reward-key {reward_key!r} not in reward {sorted(reward)}"
                )
            reward = reward[reward_key]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"sample {self.index}: reward {self.reward!r} is not a finite number")
        return float(reward)

    def scalar_reward(self) -> float:
        """What the trainer uses: `train_reward` when the rollout set it, else `reward` when it is a number."""
        if self.train_reward is not None:
            return float(self.train_reward)
        return self.reward_value(None)

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly dict (for detail dumps)."""
        d = dict(self.__dict__)
        d["status"] = self.status.value
        if self.rollout_routed_experts is not None:
            d["rollout_routed_experts"] = self.rollout_routed_experts.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """Inverse of `to_dict` (reading dumps back)."""
        d = dict(d)
        d["status"] = SampleStatus(d.get("status", "pending"))
        return cls(**d)
