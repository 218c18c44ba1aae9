"""The toy image tasks (issue 27): PIL-rendered rows with an `images` field (PNG data URIs) that the data source
reads, labels that the images determine, and the "math" reward scoring the answer exactly."""

from __future__ import annotations

import json

import pytest

from miles.rollout.multimodal import load_image
from miles.rollout.rm_hub.math_utils import math_reward
from miles.tools.toy_data import IMAGE_SIZE, IMAGE_TASKS, main, make_image_rows


def _dark_cells(img) -> int:
    """How many of the 2x2 cells hold a shape (a non-white centre pixel)."""
    half = IMAGE_SIZE // 2
    return sum(
        img.getpixel((cx * half + half // 2, cy * half + half // 2)) != (255, 255, 255)
        for cx in (0, 1)
        for cy in (0, 1)
    )


def test_count_shapes_label_is_the_number_of_shapes() -> None:
    rows = make_image_rows("count_shapes", 40, seed=1)
    assert rows == make_image_rows("count_shapes", 40, seed=1)  # deterministic
    assert {r["label"] for r in rows} == {"1", "2", "3", "4"}
    for r in rows:
        img = load_image(r["images"][0], "row")
        assert img.size == (IMAGE_SIZE, IMAGE_SIZE)
        assert _dark_cells(img) == int(r["label"])
        json.dumps(r)


def test_read_digit_images_differ_by_digit() -> None:
    rows = make_image_rows("read_digit", 40, seed=2)
    by_label: dict[str, set[bytes]] = {}
    for r in rows:
        by_label.setdefault(r["label"], set()).add(load_image(r["images"][0], "row").tobytes())
    assert set(by_label) == {"0", "1", "2", "3"}
    assert all(len(v) == 1 for v in by_label.values())  # one rendering per digit, four different ones
    assert len(set().union(*by_label.values())) == 4


def test_exact_match_reward_and_cli(tmp_path) -> None:
    (row,) = make_image_rows("read_digit", 1)
    assert math_reward(row["label"], row["label"]) == 1.0
    assert math_reward(str((int(row["label"]) + 1) % 4), row["label"]) == 0.0
    out = tmp_path / "vl.jsonl"
    main(["--task", "count_shapes", "--out", str(out), "--n", "5"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and all(x["prompt"] == "count" and len(x["images"]) == 1 for x in lines)
    with pytest.raises(ValueError, match="unknown image task"):
        make_image_rows("echo", 1)
    assert set(IMAGE_TASKS) == {"count_shapes", "read_digit", "bright_dark"}


def test_bright_dark_label_is_the_image_brightness_and_prompt_is_constant() -> None:
    from PIL import Image, ImageStat

    from miles.rollout.multimodal import load_image

    rows = make_image_rows("bright_dark", 60, seed=3)
    assert {r["prompt"] for r in rows} == {"light?"}  # only the image tells the answer
    labels = [r["label"] for r in rows]
    assert 15 < labels.count("1") < 45 and set(labels) == {"0", "1"}
    for r in rows:
        img = load_image(r["images"][0], "images")
        assert isinstance(img, Image.Image) and img.size == (IMAGE_SIZE, IMAGE_SIZE)
        mean = sum(ImageStat.Stat(img.convert("RGB")).mean) / 3
        assert (mean > 127) == (r["label"] == "1"), (mean, r["label"])
