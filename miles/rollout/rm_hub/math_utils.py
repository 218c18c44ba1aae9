"""Final-answer extraction and answer equivalence for math rewards.

Extraction (`extract_answer`), first rule that applies wins:
  1. the content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces balanced; `\\boxed 5` also
     accepted);
  2. otherwise the text after the last "answer is" / "answer:" (case-insensitive) up to the end of that line,
     with a trailing period dropped;
  3. otherwise the last number in the text (integers, decimals, comma thousands, `a/b` fractions, a sign).
  No match gives None.

Equivalence (`is_equiv`): both sides are normalised (spaces, `$`, a trailing `.`, `\\left`/`\\right`,
spacing commands, `\\text{}`/`\\mathrm{}`/`\\textbf{}` wrappers and `^\\circ` removed;
`\\dfrac`/`\\tfrac` -> `\\frac`) and compared as strings; if both parse as numbers they are compared
numerically (relative tolerance 1e-6). Numbers include `\\frac{a}{b}`, `\\frac12`, `a/b`, decimals, comma
thousands (`1,234`) and percentages (`50\\%` == `50`).
"""

from __future__ import annotations

import math
import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|-?\.\d+")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_WRAPPERS_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}`/`\\fbox{...}` in `text` (braces balanced), or None.

    `\\boxed 5` (no braces) yields the token after the space. An unclosed brace yields None.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    if rest.startswith(" "):
        m = re.match(r"\s+([^\s$]+)", rest)
        return m.group(1) if m else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: boxed content, else "answer is X", else the last number (or None)."""
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches:
        ans = matches[-1].group(1).strip().rstrip(".").strip()
        if ans:
            return ans
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(ans: str) -> str:
    """Canonical string form of an answer (see the module docstring for the rules)."""
    s = ans.strip()
    for old in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$"):
        s = s.replace(old, "")
    for old in ("\\dfrac", "\\tfrac"):
        s = s.replace(old, "\\frac")
    prev = None
    while prev != s:  # unwrap nested \text{...}
        prev, s = s, _WRAPPERS_RE.sub(r"\1", s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "%")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s


def parse_number(ans: str) -> float | None:
    """The numeric value of a normalised answer, or None when it is not a plain number/fraction/percentage."""
    s = ans.rstrip("%") if ans.endswith("%") else ans
    sign = 1.0
    if s.startswith("-"):
        sign, s = -1.0, s[1:]
    m = _FRAC_RE.fullmatch(s) or _FRAC_SHORT_RE.fullmatch(s)
    if m:
        num, den = _plain_number(m.group(1)), _plain_number(m.group(2))
    elif s.count("/") == 1:
        a, b = s.split("/")
        num, den = _plain_number(a), _plain_number(b)
    else:
        value = _plain_number(s)
        return None if value is None else sign * value
    if num is None or den is None or den == 0:
        return None
    return sign * num / den


def _plain_number(s: str) -> float | None:
    s = s.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    return float(s)


def is_equiv(pred: str, label: str) -> bool:
    """Whether answer `pred` equals `label` after normalisation, numerically when both are numbers."""
    a, b = normalize_answer(pred), normalize_answer(label)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def math_reward(response: str, label: object) -> float:
    """1.0 when the final answer of `response` equals `label` (a `\\boxed{}` label is unwrapped), else 0.0."""
    return answer_reward(extract_answer(response), label)


def answer_reward(pred: str | None, label: object) -> float:
    """1.0 when the extracted answer `pred` equals `label` (a `\\boxed{}` label is unwrapped), else 0.0."""
    if label is None:
        raise ValueError("math reward needs a label; got None (check --label-key)")
    label_text = str(label)
    boxed_label = last_boxed_content(label_text)
    if boxed_label is not None:
        label_text = boxed_label
    if pred is None:
        return 0.0
    return 1.0 if is_equiv(pred, label_text) else 0.0
