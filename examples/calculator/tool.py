"""The calculator tool and the reward of the calculator example.

Pass them as
  --custom-generate-function-path miles.rollout.multi_turn.generate_multi_turn
  --generate-execute-tool-function-path examples.calculator.tool:calculator
  --custom-rm-path examples.calculator.tool:calculator_reward
"""

from __future__ import annotations

import re

from miles.rollout.rm_hub import RewardContext
from miles.utils.types import Sample

_EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def evaluate(expression: str) -> int:
    """`a op b` with integers a, b and op one of + - *; ValueError for anything else."""
    m = _EXPRESSION.match(expression)
    if not m:
        raise ValueError(f"cannot evaluate {expression!r}: expected 'a + b', 'a - b' or 'a * b'")
    return _OPS[m.group(2)](int(m.group(1)), int(m.group(3)))


def calculator(arguments: str, sample: Sample) -> str:
    """Evaluate the expression in the call. A call without a complete expression evaluates the question's
    (the sample's `metadata["expression"]`): the tool is bound to the task, like a sandbox bound to a
    repository, so the tiny model only has to learn when to call it and how to use its answer."""
    if _EXPRESSION.match(arguments) or "expression" not in sample.metadata:
        return str(evaluate(arguments))
    return str(evaluate(sample.metadata["expression"]))


_NUMBER = re.compile(r"-?\d+")


def calculator_reward(ctx: RewardContext, sample: Sample) -> float:
    """1.0 when the final model turn answers the label (its first number). Otherwise partial credit that makes
    each step towards using the tool worth repeating: 0.4 for calling it, 0.3 more for then answering a number
    (the wrong one)."""
    final = sample.metadata.get("final_turn", sample.response)
    numbers = _NUMBER.findall(final) if "<tool_call>" not in final else []
    if numbers and numbers[0] == str(sample.label):
        return 1.0
    called = sample.metadata.get("tool_calls", 0) > 0
    return 0.4 * called + 0.3 * (called and bool(numbers))
