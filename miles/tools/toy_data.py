"""Toy prompt datasets that a tiny, randomly initialised model can learn by RL (GRPO) in minutes on a CPU.

Every task maps a prompt to a one-digit answer determined by the prompt. Rows are written as JSONL, by default
with plain-string prompts (`--format plain`, run with `--input-key prompt --label-key label` and no chat
template):

    {"prompt": "echo 3 3 3 3", "label": "3"}

or, with `--format chat`, as chat messages (run with `--apply-chat-template`; a plain-string prompt given to
`--apply-chat-template` is read as one user message, which is the same thing):

    {"prompt": [{"role": "user", "content": "echo 3 3 3 3"}], "label": "3"}

`label` is the answer as a string, scored with the "math" reward (the last number of the response). A
random policy of the tiny model hits it now and then (~5% with 2 new tokens: a digit is ~1/5 of its
vocabulary), which is the learning signal GRPO needs; both formats learn it within ~40 steps of 16 prompts x
8 samples (see `miles.tools.check_learnability` for the measured curves).

    python -m miles.tools.toy_data --task echo --out data.jsonl --n 1000 --seed 0

Image tasks (VLM, issue 27) render one small image per row with PIL and write it in an `images` field as a PNG
data URI (run with `--multimodal-keys '{"image": "images"}'`); the label is again one digit, scored with "math":

    {"prompt": "count", "label": "3", "images": ["data:image/png;base64,..."]}

`count_shapes`: 1-4 filled shapes (circles or squares) on a 56x56 canvas, answer their number; `read_digit`: one
digit 0-3 drawn large, answer it; `bright_dark`: a bright (answer 1) or dark (answer 0) image, one prompt
("light?") for every row, so only the image tells the answer (chance 0.5).

    python -m miles.tools.toy_data --task count_shapes --out vl.jsonl --n 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

DIGITS = "0123456789"


@dataclass(frozen=True)
class ToyTask:
    """A toy task: `make(rng) -> (user_text, label)`; `words` are all words that can appear in a prompt."""

    name: str
    description: str
    make: Callable[[random.Random], tuple[str, str]]
    words: tuple[str, ...]


def _echo(digits: str, repeats: int) -> Callable[[random.Random], tuple[str, str]]:
    def make(rng: random.Random) -> tuple[str, str]:
        d = rng.choice(digits)
        return "echo " + " ".join([d] * repeats), d

    return make


# The digit is repeated so that it dominates what the last prompt position attends to at initialisation:
# through the chat template (which ends in "<|im_start|>assistant\n") a single digit is learned several times
# slower. Four answers keep the per-answer signal of a 128-sample step large enough.
TASKS: dict[str, ToyTask] = {
    t.name: t
    for t in (
        ToyTask("echo", "the repeated digit, one of 0-3: 'echo 3 3 3 3' -> '3'", _echo("0123", 4), ("echo",)),
        ToyTask(
            "echo10",
            "the repeated digit, one of 0-9 (learns about twice slower): 'echo 7 7 7 7' -> '7'",
            _echo(DIGITS, 4),
            ("echo",),
        ),
    )
}
FORMATS = ("plain", "chat")
DEFAULT_TASK = "echo"
IMAGE_SIZE = 56  # the tiny VL image processor's smallest image: 4x4 patches, 4 image tokens
IMAGE_TASKS = {
    "count_shapes": "count the 1-4 shapes in the image: 'count' -> '3'",
    "read_digit": "read the digit 0-3 drawn in the image: 'digit' -> '2'",
    "bright_dark": "is the image bright (1) or dark (0); the same prompt for every row: 'light?' -> '1'",
}
_IMAGE_PROMPTS = {"count_shapes": "count", "read_digit": "digit", "bright_dark": "light?"}


def render_count_shapes(rng: random.Random, size: int = IMAGE_SIZE) -> tuple[object, str]:
    """(a PIL image of 1-4 non-overlapping filled shapes on a 2x2 grid of cells, their number as a string)."""
    from PIL import Image, ImageDraw

    n = rng.randint(1, 4)
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cell = size // 2
    for k in rng.sample(range(4), n):
        x, y = (k % 2) * cell + 4, (k // 2) * cell + 4
        color = tuple(rng.randint(0, 160) for _ in range(3))
        box = (x, y, x + cell - 8, y + cell - 8)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    return img, str(n)


def render_read_digit(rng: random.Random, size: int = IMAGE_SIZE) -> tuple[object, str]:
    """(a PIL image with one digit 0-3 drawn large in black on white, the digit)."""
    from PIL import Image, ImageDraw, ImageFont

    d = rng.choice("0123")
    img = Image.new("RGB", (size, size), (255, 255, 255))
    font = ImageFont.load_default(size=size * 3 // 4)
    ImageDraw.Draw(img).text((size // 2, size // 2), d, fill=(0, 0, 0), font=font, anchor="mm")
    return img, d


def render_bright_dark(rng: random.Random, size: int = IMAGE_SIZE) -> tuple[object, str]:
    """(a PIL image filled with a random bright or dark colour and a smaller shape of any colour, "1"/"0").

    Two classes, chosen with equal odds: a bright background (every channel 170-255) answers "1", a dark one
    (0-85) answers "0". A smaller shape of a random colour covers at most a ninth of the canvas, so the class
    is the image's overall brightness, not a single pixel value. The prompt is the same for every row, so the
    text alone cannot beat chance (0.5 once the answer is "0" or "1"): a reward above it means the model reads
    the image.
    """
    from PIL import Image, ImageDraw

    bright = rng.random() < 0.5
    lo, hi = (170, 255) if bright else (0, 85)
    img = Image.new("RGB", (size, size), tuple(rng.randint(lo, hi) for _ in range(3)))
    side = rng.randint(size // 6, size // 3)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    shape_color = tuple(rng.randint(0, 255) for _ in range(3))
    box = (x, y, x + side - 1, y + side - 1)
    draw = ImageDraw.Draw(img)
    (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=shape_color)
    return img, "1" if bright else "0"


_RENDER = {
    "count_shapes": render_count_shapes,
    "read_digit": render_read_digit,
    "bright_dark": render_bright_dark,
}


def make_image_rows(task: str, n: int, seed: int = 0) -> list[dict[str, object]]:
    """`n` rows of the image task `task`, deterministic in `seed`: `{"prompt", "label", "images": [data URI]}`."""
    from miles.rollout.multimodal import image_data_uri

    if task not in IMAGE_TASKS:
        raise ValueError(f"unknown image task {task!r}; choose one of {sorted(IMAGE_TASKS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    render, prompt = _RENDER[task], _IMAGE_PROMPTS[task]
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        img, label = render(rng)
        rows.append({"prompt": prompt, "label": label, "images": [image_data_uri(img)]})  # type: ignore[arg-type]
    return rows


def get_task(name: str) -> ToyTask:
    """Return the toy task called `name`; ValueError listing the known tasks otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown toy task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


class ToyRow(TypedDict):
    prompt: str | list[dict[str, str]]  # plain text, or chat messages
    label: str


def make_rows(task: str, n: int, seed: int = 0, fmt: str = "plain") -> list[ToyRow]:
    """`n` rows of `task`, deterministic in `seed`.

    `fmt="plain"`: `{"prompt": "echo 3 3 3 3", "label": "3"}`;
    `fmt="chat"`: `{"prompt": [{"role": "user", "content": "echo 3 3 3 3"}], "label": "3"}`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    spec = get_task(task)
    rng = random.Random(seed)
    rows: list[ToyRow] = []
    for _ in range(n):
        text, label = spec.make(rng)
        prompt: str | list[dict[str, str]] = text if fmt == "plain" else [{"role": "user", "content": text}]
        rows.append({"prompt": prompt, "label": label})
    return rows


def tokenizer_corpus(task: str) -> list[str]:
    """Texts to train the tiny tokenizer on: chat-formatted examples of `task` (all tasks' words included).

    The corpus covers every character a prompt, chat template or answer of any toy task can contain, so a
    tokenizer trained on it encodes them losslessly.
    """
    get_task(task)
    texts: list[str] = []
    words = [w for t in TASKS.values() for w in t.words]
    for role in ("system", "user", "assistant"):
        for w in words:
            for d in DIGITS:
                texts.append(f"<|im_start|>{role}\n{w} {d}<|im_end|>\n")
    rng = random.Random(0)
    spec = TASKS[task]
    for _ in range(200):
        text, label = spec.make(rng)
        texts.append(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{label}<|im_end|>\n")
    texts.append("The answer is 0123456789. " + " ".join(DIGITS))
    return texts


def write_jsonl(rows: Sequence[Mapping[str, object]], out: str | os.PathLike[str]) -> Path:
    """Write rows to `out` as JSONL atomically (temp file + rename); returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI: write a toy dataset as JSONL."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--task", default=DEFAULT_TASK, choices=sorted(TASKS) + sorted(IMAGE_TASKS), help="which toy task"
    )
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--n", type=int, default=1000, help="number of rows")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--format", default="plain", choices=FORMATS, help="plain string prompts or chat messages")
    a = p.parse_args(argv)
    if a.task in IMAGE_TASKS:
        path = write_jsonl(make_image_rows(a.task, a.n, a.seed), a.out)
    else:
        path = write_jsonl(make_rows(a.task, a.n, a.seed, a.format), a.out)
    print(f"wrote {a.n} rows of task {a.task!r} to {path}")


if __name__ == "__main__":
    main()
