"""The typed records that cross the rollout seams, and the seams' protocols.

Four functions can be replaced by path (`module.path:function` or `module.path.function`); each is checked at
start-up (`miles.rollout.seams.load_seams`), which names the flag and the path when it does not import or has
the wrong shape:

- a per-sample generate function (`--custom-generate-function-path`), `GenerateFn`;
- a group filter for dynamic sampling (`--dynamic-sampling-filter-path`), `GroupFilterFn`;
- a whole-rollout function (`--rollout-function-path`), `RolloutFn`, and an eval function
  (`--eval-function-path`), `EvalFn`; the defaults (`miles.rollout.default_rollout`) are written on the same
  seams.

Reward functions (`--custom-rm-path`, `--custom-reward-post-process-path`) are described in
`miles.rollout.rm_hub`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from miles.utils.types import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from miles.rollout.data_source import RolloutDataSource
    from miles.rollout.generate_client import GenerateClient
    from miles.rollout.rm_hub.scoring import RewardScorer


@dataclass(frozen=True)
class SamplingSettings:
    """SGLang `sampling_params` of one generate request (max_new_tokens is the whole response budget)."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = False

    def to_request(self, max_new_tokens: int | None = None) -> dict[str, object]:
        """The request's `sampling_params`; `max_new_tokens` overrides the budget (e.g. what is left of it)."""
        params: dict[str, object] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


ToolFn = Callable[[str, Sample], "str | Awaitable[str]"]
"""A tool for the multi-turn generate function: `tool(arguments, sample) -> str` (sync or async).

`arguments` is the text inside the model's `<tool_call>...</tool_call>`; `sample` is the sample being generated
(read its `metadata` for a per-sample environment; do not modify it). The returned text is the tool's answer.
"""


@dataclass(frozen=True)
class MultiTurnSettings:
    """What the stock multi-turn generate function needs (`--generate-*` flags)."""

    max_turns: int  # model turns per sample, tool answers in between
    tool: ToolFn  # loaded from --generate-execute-tool-function-path
    tool_timeout: float  # seconds per tool call
    tool_name: str = ""  # the flag value, for error messages


@dataclass(frozen=True)
class AgentSettings:
    """What the session-server generate function needs (`--use-session-server`, `--agent-*` flags)."""

    run: Callable[..., Awaitable[object]]  # `async def run(base_url, sample, ctx) -> reward | None`
    name: str  # the --agent-function-path value, for error messages
    timeout: float  # --agent-timeout: seconds one episode may take
    pick: Callable[..., list] | None = None  # --session-sample-picker-path; None: picking.pick_leaves
    postprocess: Callable[..., list] | None = None  # --session-sample-postprocessor-path; None: exactly once
    has_reward_fn: bool = True  # --rm-type, --custom-rm-path or --rm-url set: an agent may return None


@dataclass(frozen=True)
class GenerateContext:
    """What a generate function gets besides the generate client, the sample and the sampling settings."""

    tokenizer: PreTrainedTokenizerBase
    request_id_prefix: str  # e.g. "rollout12" or "eval-aime-12": request ids are `<prefix>-<sample index>...`
    evaluation: bool = False
    multi_turn: MultiTurnSettings | None = None
    agent: AgentSettings | None = None

    @property
    def phase(self) -> str:
        """How errors name the phase this generation belongs to."""
        return f"{'eval' if self.evaluation else 'rollout'} generate ({self.request_id_prefix})"


class GenerateFn(Protocol):
    """`async def generate(client, sample, sampling, ctx) -> Sample`.

    Called once per sample (again in the next rollout for a partial sample that was aborted). The sample's
    `tokens` hold the prompt ids (plus any response generated so far, `response_length` of them). Return the
    sample with the response appended (`Sample.append_tokens`), `status` set, and one `weight_versions` entry
    per generated segment; its token ids, loss mask and log-probs must agree in length. An episode that yields
    several training samples (`--use-session-server`: a session's picked leaves) returns them as a list, its own
    first; the group holds them all (`default_rollout.generate_group`).
    """

    def __call__(
        self, client: GenerateClient, sample: Sample, sampling: SamplingSettings, ctx: GenerateContext
    ) -> Awaitable[Sample | list[Sample]]: ...


@dataclass(frozen=True)
class FilterResult:
    """A group filter's verdict; `reason` names why a group was dropped (counted in metrics)."""

    keep: bool
    reason: str | None = None


class GroupFilterFn(Protocol):
    """`def filter(group, reward_key) -> FilterResult` (a bool is read as `FilterResult(keep=bool)`).

    Called once per finished, scored prompt group; `reward_key` is `--reward-key` (for dict rewards).
    """

    def __call__(self, group: list[Sample], reward_key: str | None) -> FilterResult | bool: ...


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout flags the default rollout reads (plain values, no configuration namespace)."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    over_sampling_batch_size: int
    sampling: SamplingSettings
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    reward_key: str | None = None


@dataclass
class RolloutContext:
    """Everything a whole-rollout function works with. Built by the rollout runner for each call."""

    client: GenerateClient
    data_source: RolloutDataSource
    settings: RolloutSettings
    generate: GenerateFn
    generate_ctx: GenerateContext
    group_filter: GroupFilterFn | None
    scorer: RewardScorer
    generate_name: str = "miles.rollout.generate.generate_single_turn"  # for error messages
    filter_name: str = "(none)"


@dataclass
class RolloutOutput:
    """A whole-rollout function's result: exactly `rollout_batch_size` prompt groups of finished samples."""

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSet:
    """One eval dataset as the eval function sees it: its name, its prompt groups source and sampling."""

    name: str
    data_source: RolloutDataSource
    sampling: SamplingSettings
    n_samples_per_prompt: int


@dataclass
class EvalOutput:
    """An eval function's result: metrics (`eval/<set>/...`) and the scored samples per set (for dumps)."""

    metrics: dict[str, float]
    samples: dict[str, list[Sample]] = field(default_factory=dict)


class RolloutFn(Protocol):
    """`async def rollout(ctx: RolloutContext, rollout_id: int) -> RolloutOutput`."""

    def __call__(self, ctx: RolloutContext, rollout_id: int) -> Awaitable[RolloutOutput]: ...


class EvalFn(Protocol):
    """`async def evaluate(ctx: RolloutContext, eval_sets: list[EvalSet], rollout_id: int) -> EvalOutput`."""

    def __call__(
        self, ctx: RolloutContext, eval_sets: list[EvalSet], rollout_id: int
    ) -> Awaitable[EvalOutput]: ...
