"""Images in prompt data (issue 27): --multimodal-keys parsing and validation, image loading from paths, base64,
bytes and HF image dicts, and errors that name the sample and the field."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from miles.config import ConfigError, parse_config
from miles.rollout.multimodal import load_image, load_sample_images, parse_multimodal_keys

REQUIRED = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "3", "--colocate"]
REQUIRED += ["--rollout-batch-size", "2", "--global-batch-size", "2"]


def _png(color: tuple[int, int, int] = (10, 200, 30), size: tuple[int, int] = (20, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_parse_multimodal_keys() -> None:
    assert parse_multimodal_keys('{"image": "images"}') == {"image": "images"}
    assert parse_multimodal_keys(None) is None
    for bad, words in [
        ("{image", "not JSON"),
        ('["images"]', "JSON object"),
        ('{"video": "v"}', "'video' is not supported"),
        ('{"image": 3}', "non-empty string"),
    ]:
        with pytest.raises(ValueError, match="--multimodal-keys") as e:
            parse_multimodal_keys(bad)
        assert words in str(e.value)


def test_every_image_form_loads(tmp_path: Path) -> None:
    data = _png()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [
        str(path),
        data,
        b64,
        f"data:image/png;base64,{b64}",
        {"bytes": data, "path": None},
        Image.open(path),
    ]
    for form in forms:
        img = load_image(form, "x")
        assert img.mode == "RGB" and img.size == (20, 10) and img.getpixel((0, 0)) == (10, 200, 30)


def test_several_images_per_sample_in_order(tmp_path: Path) -> None:
    row = {"images": [_png((255, 0, 0)), _png((0, 0, 255), (8, 8))], "prompt": "hi"}
    images = load_sample_images(row, {"image": "images"}, "d.jsonl: line 1")
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 0, 255)]
    assert load_sample_images({"prompt": "text only"}, {"image": "images"}, "d.jsonl: line 2") == []


@pytest.mark.parametrize(
    "value, words",
    [
        ("https://example.com/cat.png", "is a URL; miles reads images offline"),
        ("missing.png", "no image file 'missing.png'"),
        (b"not an image at all", "cannot read the image"),
        (_png()[:40], "cannot read the image"),  # truncated PNG
        (42, "got int"),
    ],
)
def test_bad_image_names_sample_and_field(value: object, words: str) -> None:
    with pytest.raises(ValueError) as e:
        load_sample_images({"images": [_png(), value]}, {"image": "images"}, "d.jsonl: line 7")
    msg = str(e.value)
    assert msg.startswith("d.jsonl: line 7: field 'images' (image 1)"), msg
    assert words in msg


def test_validation_refuses_unproven_vl_runs_naming_issue_27(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    text_run = [*REQUIRED, "--hf-checkpoint", str(text)]
    with pytest.raises(ConfigError) as e:
        parse_config(text_run + ["--multimodal-keys", '{"image": "images"}'])
    assert "--multimodal-keys" in str(e.value) and "issue 27" in str(e.value)
    with pytest.raises(ConfigError, match="modality 'audio' is not supported"):
        parse_config(REQUIRED + ["--multimodal-keys", '{"audio": "a"}'])
    with pytest.raises(ConfigError, match="--freeze-vision-tower.*issue 27"):
        parse_config(text_run + ["--freeze-vision-tower"])
    # a checkpoint not there yet (no config.json) is left to the pre-flight checks, which name the missing path
    parse_config(REQUIRED + ["--multimodal-keys", '{"image": "images"}', "--freeze-vision-tower"])
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}))
    argv = [
        *REQUIRED,
        "--hf-checkpoint",
        str(vl),
        "--actor-num-gpus-per-node",
        "2",
        "--context-parallel-size",
        "2",
    ]
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    text = str(e.value)
    assert "--context-parallel-size=2: context parallelism is not supported for vision-language" in text
    assert "issue 27" in text
    base = [*REQUIRED, "--hf-checkpoint", str(vl), "--multimodal-keys", '{"image": "images"}']
    with pytest.raises(ConfigError, match="--lora-rank.*not proven.*issue 27"):
        parse_config(base + ["--lora-rank", "8"])
    parse_config(base + ["--rollout-engine", "sglang"])  # allowed, untested here (docs/vlm.md)
    parse_config(base)  # what the e2e test runs: accepted
    parse_config(base + ["--freeze-vision-tower"])
    parse_config(REQUIRED)  # text-only runs are untouched
