"""Loading the rollout seams by path and checking their shape at start-up.

`load_seams(rollout_cfg, eval_cfg)` imports every function the rollout flags name and checks that each one
takes the arguments its protocol passes (and is `async def` where the protocol awaits it). Any problem raises
ValueError naming the flag, the path and the expected signature, before Ray or any engine starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.rollout.base_types import (
    AgentSettings,
    EvalFn,
    GenerateFn,
    GroupFilterFn,
    MultiTurnSettings,
    RolloutFn,
    ToolFn,
)
from miles.utils.misc import load_function

if TYPE_CHECKING:
    from miles.config.sections import EvalConfig, RolloutConfig

DEFAULT_GENERATE = "miles.rollout.generate.generate_single_turn"
SESSION_GENERATE = "miles.rollout.session.agent.generate_with_agent"  # with --use-session-server


def _accepts(fn: Callable[..., object], n: int) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return True
    try:
        sig.bind(*([None] * n))
    except TypeError:
        return False
    return True


def _is_async(fn: Callable[..., object]) -> bool:
    call = type(fn).__call__ if not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


# returns a function of the protocol `shape` describes (checked by arity here, by type only at its call site)
def load_checked(path: str, flag: str, shape: str, n_args: int, must_be_async: bool) -> Callable[..., Any]:
    """Import `path` for `flag` and check it can be called with `n_args` positional arguments (and is async
    when `must_be_async`); ValueError naming flag, path and `shape` (the expected signature) otherwise."""
    fn = load_function(path, flag)
    if not _accepts(fn, n_args):
        raise ValueError(
            f"{flag}={path!r}: expected {shape}; {fn.__qualname__}{inspect.signature(fn)} does not fit"
        )
    if must_be_async and not _is_async(fn):
        raise ValueError(
            f"{flag}={path!r}: expected {shape} (an `async def`); {fn.__qualname__} is not async"
        )
    return fn


@dataclass(frozen=True)
class Seams:
    """The loaded rollout functions, with the paths they came from (for error messages)."""

    generate: GenerateFn
    generate_name: str
    group_filter: GroupFilterFn | None
    filter_name: str
    rollout: RolloutFn
    rollout_name: str
    evaluate: EvalFn
    eval_name: str
    multi_turn: MultiTurnSettings | None
    agent: AgentSettings | None = None


def load_agent(rollout_cfg: RolloutConfig) -> AgentSettings | None:
    """The agent of --agent-function-path with --use-session-server (None without), checked like the seams."""
    r = rollout_cfg
    if not r.use_session_server:
        return None
    if not r.agent_function_path:
        raise ValueError(
            "--use-session-server needs --agent-function-path (async def run(base_url, sample, ctx))"
        )
    run = load_checked(
        r.agent_function_path, "--agent-function-path", "async def run(base_url, sample, ctx) -> reward | None",
        3, True,
    )  # fmt: skip
    pick = post = None
    if r.session_sample_picker_path:
        pick = load_checked(
            r.session_sample_picker_path, "--session-sample-picker-path", "def pick(session) -> list[Node]",
            1, False,
        )  # fmt: skip
    if r.session_sample_postprocessor_path:
        post = load_checked(
            r.session_sample_postprocessor_path, "--session-sample-postprocessor-path",
            "def post(samples, leaves) -> list[Sample]", 2, False,
        )  # fmt: skip
    has_reward_fn = bool(r.rm_type or r.custom_rm_path or r.rm_url)
    return AgentSettings(run, r.agent_function_path, r.agent_timeout, pick, post, has_reward_fn)


def load_seams(rollout_cfg: RolloutConfig, eval_cfg: EvalConfig) -> Seams:
    """Load and check every rollout function named by the `rollout` and `eval` config sections."""
    r = rollout_cfg
    agent = load_agent(r)
    gen_path = SESSION_GENERATE if agent else (r.custom_generate_function_path or DEFAULT_GENERATE)
    generate = load_checked(
        gen_path, "--custom-generate-function-path", "async def generate(client, sample, sampling, ctx) -> Sample",
        4, True,
    )  # fmt: skip
    group_filter = None
    if r.dynamic_sampling_filter_path:
        group_filter = load_checked(
            r.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path",
            "def filter(group, reward_key) -> FilterResult | bool", 2, False,
        )  # fmt: skip
    rollout = load_checked(
        r.rollout_function_path, "--rollout-function-path", "async def rollout(ctx, rollout_id) -> RolloutOutput",
        2, True,
    )  # fmt: skip
    evaluate = load_checked(
        eval_cfg.eval_function_path, "--eval-function-path",
        "async def evaluate(ctx, eval_sets, rollout_id) -> EvalOutput", 3, True,
    )  # fmt: skip
    multi_turn = None
    if r.generate_execute_tool_function_path:
        tool: ToolFn = load_checked(
            r.generate_execute_tool_function_path, "--generate-execute-tool-function-path",
            "def tool(arguments: str, sample) -> str (sync or async)", 2, False,
        )  # fmt: skip
        multi_turn = MultiTurnSettings(
            max_turns=r.generate_max_turns,
            tool=tool,
            tool_timeout=r.generate_tool_timeout,
            tool_name=r.generate_execute_tool_function_path,
        )
    return Seams(
        generate=generate,
        generate_name=gen_path,
        group_filter=group_filter,
        filter_name=r.dynamic_sampling_filter_path or "(none)",
        rollout=rollout,
        rollout_name=r.rollout_function_path,
        evaluate=evaluate,
        eval_name=eval_cfg.eval_function_path,
        multi_turn=multi_turn,
        agent=agent,
    )
