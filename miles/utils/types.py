"""Records passed between the rollout side and the trainer.

Token ids are the only currency between rollout and trainer: nothing is re-tokenized on the training side.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # the engine stopped on EOS or a stop string/token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # the request was aborted (e.g. pause for refit)
    FAILED = "failed"  # reward or generation failed; the sample carries no learning signal


@dataclass
class Sample:
    """One prompt + one response, as generated and scored.

    `tokens` is prompt ids followed by response ids; `response_length` counts the trailing response ids.
    `loss_mask` and `rollout_log_probs` are per response token (length `response_length`).
    """

    index: int = 0  # position in the rollout batch
    group_index: int = 0  # which prompt group (the n samples of one prompt share it)
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)  # [prompt_len + response_length]
    response_length: int = 0
    response: str = ""
    label: Any = None
    reward: float | dict[str, float] | None = None
    loss_mask: list[int] | None = None  # [response_length]
    rollout_log_probs: list[float] | None = None  # [response_length]
    weight_versions: list[str] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["status"] = SampleStatus(d.get("status", "pending"))
        return cls(**d)
