"""Rule-based scorers for the `dapo`, `f1` and `gpqa` reward types (pure string functions).

- `dapo_score`: DAPO's math check. The answer is the text after the last "Answer:" in the last 300 characters
  of the response; answer and label are normalised (text after the last '=', units and LaTeX wrappers
  dropped, thousands separators removed) and compared as strings, the label as an integer when it is one.
  Returns `{"score": 1.0 | -1.0, "acc": 1.0 | 0.0}` (train on `--reward-key score`).
- `f1_score`: SQuAD token F1 between the response and the label (lower-cased, punctuation and the articles
  a/an/the removed); a list label scores against its best element.
- `gpqa_score`: a multiple-choice letter. The chosen letter is the one after "answer is"/"answer:"/"option"
  (or a parenthesised "(X)"), else the last standalone valid capital letter; the correct letter is the label
  when it is a letter, `valid_letters[label]` when it is an index, or the letter of the choice in
  `metadata["choices"]` whose text equals the label. 1.0 or 0.0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping

from miles.utils.types import JSON

_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_UNITS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "points", "feet",
    "minutes", "digits", "cents", "degrees", "cm", "meters", "pounds", "\\ldots", "\\dots",
)  # fmt: skip
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|overline|boxed)\{(.*?)\}")


def _dapo_normalize(answer: str) -> str:
    s = str(answer).split("=")[-1]
    for unit in _DAPO_UNITS:
        s = s.replace(unit, "")
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\!", "").replace("$", "")
    s = s.replace("\\ ", "").replace(" ", "").strip().rstrip(".")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s


def dapo_score(response: str, label: object) -> dict[str, float]:
    """DAPO's reward: +1 / -1 for a right / wrong "Answer: X", with the 0/1 accuracy alongside."""
    if label is None:
        raise ValueError("dapo reward needs a label; got None (check --label-key)")
    matches = _DAPO_ANSWER.findall(response[-300:])
    pred = _dapo_normalize(matches[-1]) if matches else None
    gold = _dapo_normalize(str(label))
    try:
        gold = str(int(float(gold)))  # DAPO's labels are integers
    except ValueError:
        pass
    correct = pred is not None and pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}


def _f1_tokens(text: object) -> list[str]:  # labels may be numbers: compared as text
    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    return [w for w in text.split() if w not in ("a", "an", "the")]


def f1_score(response: str, label: object) -> float:
    """SQuAD-style token F1 in [0, 1]; the best over the labels when `label` is a list."""
    if label is None:
        raise ValueError("f1 reward needs a label; got None (check --label-key)")
    labels = label if isinstance(label, list) else [label]
    pred = _f1_tokens(response)
    best = 0.0
    for gold_text in labels:
        gold = _f1_tokens(gold_text)
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold:
            score = float(pred == gold)
        elif common == 0:
            score = 0.0
        else:
            precision, recall = common / len(pred), common / len(gold)
            score = 2 * precision * recall / (precision + recall)
        best = max(best, score)
    return best


_GPQA_PATTERNS = (
    re.compile(r"answer\s*(?:is|:)\s*:?\s*\(?([A-Za-z])\b\)?", re.IGNORECASE),
    re.compile(r"(?:option|choice)\s*:?\s*\(?([A-Za-z])\b\)?", re.IGNORECASE),
    re.compile(r"\(([A-Z])\)"),
)


def _letters(metadata: Mapping[str, JSON]) -> list[str]:
    valid = metadata.get("valid_letters")
    if valid and isinstance(valid, list | str | dict):
        return [str(x).strip().upper() for x in valid]
    choices = metadata.get("choices")
    n = len(choices) if choices and isinstance(choices, list | str | dict) else 10
    return list(string.ascii_uppercase[:n])


def _choice_texts(metadata: Mapping[str, JSON]) -> list[str]:
    choices = metadata.get("choices") or []
    if isinstance(choices, dict):
        return [str(c) for c in choices.values()]
    return [str(c) for c in choices] if isinstance(choices, list | str) else []


def gpqa_score(response: str, label: object, metadata: Mapping[str, JSON]) -> float:
    """1.0 when the response picks the correct multiple-choice letter, else 0.0."""
    letters = _letters(metadata)
    correct = None
    if isinstance(label, str) and label.strip().upper() in letters:
        correct = label.strip().upper()
    elif isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(letters):
        correct = letters[label]
    elif isinstance(label, str):
        wanted = " ".join(_f1_tokens(label))
        for letter, text in zip(letters, _choice_texts(metadata)):
            if " ".join(_f1_tokens(text)) == wanted:
                correct = letter
    if correct is None:
        raise ValueError(
            f"gpqa reward: cannot tell the correct letter from label {label!r} "
            f"(valid letters {letters}, choices {_choice_texts(metadata)})"
        )
    text = response.rsplit("</think>", 1)[-1]
    chosen = None
    for pattern in _GPQA_PATTERNS:
        found = [m.upper() for m in pattern.findall(text) if m.upper() in letters]
        if found:
            chosen = found[-1]
            break
    if chosen is None:
        standalone = [m for m in re.findall(r"\b([A-Z])\b", text) if m in letters]
        chosen = standalone[-1] if standalone else None
    return 1.0 if chosen == correct else 0.0
