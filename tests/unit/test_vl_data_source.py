"""The data source of a VL run (issue 27): --multimodal-keys fills `Sample.multimodal_data` (PNG data URIs, JSON
serialisable) and the prompt ids are the processor's expanded ids; a bad image names the row and the field."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoTokenizer

from miles.rollout.data_source import PromptDataset, RolloutDataSource
from miles.rollout.multimodal import VLProcessor, images_of_sample
from miles.tools.tiny_vlm import build_tiny_vlm


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vl") / "m", "qwen2_5_vl"))


def _png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _dataset(vl_dir: str, path: Path) -> PromptDataset:
    tok = AutoTokenizer.from_pretrained(vl_dir)
    return PromptDataset(
        path,
        "prompt",
        "label",
        None,
        tok,
        apply_chat_template=False,
        multimodal_keys={"image": "images"},
        processor=VLProcessor.for_tokenizer(tok),
    )


def test_rows_carry_images_and_expanded_ids(vl_dir: str, tmp_path: Path) -> None:
    red = tmp_path / "red.png"
    red.write_bytes(_png((255, 0, 0), (60, 50)))

    blue = base64.b64encode(_png((0, 0, 255), (112, 56))).decode()
    rows = [
        {"prompt": "count 2", "label": "2", "images": [str(red), blue]},
        {"prompt": "what is 1", "label": "1"},  # no image field: a text-only row
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = _dataset(vl_dir, data)
    proc = ds.processor
    assert proc is not None
    first, second = ds[0], ds[1]
    expected_ids, mm = proc.encode(
        "count 2", [Image.open(red).convert("RGB"), Image.new("RGB", (112, 56), (0, 0, 255))]
    )
    assert first.prompt_ids == expected_ids
    assert mm is not None and sum(t == proc.image_token_id for t in expected_ids) == int(
        (mm.image_grid_thw.prod(-1) // 4).sum()
    )
    assert first.multimodal_data is not None and len(first.multimodal_data["image"]) == 2
    assert all(u.startswith("data:image/png;base64,") for u in first.multimodal_data["image"])
    assert second.multimodal_data is None and proc.image_token_id not in second.prompt_ids

    (group,) = RolloutDataSource(ds, n_samples_per_prompt=2, shuffle=False, seed=0).next_batch(1)
    s = group[0]
    assert s.tokens == expected_ids and s.multimodal_data == first.multimodal_data
    assert group[1].multimodal_data is not group[0].multimodal_data  # each sample its own copy
    json.dumps(s.to_dict())  # debug dumps
    images = images_of_sample(s.multimodal_data, "sample 0")
    assert [im.size for im in images] == [(60, 50), (112, 56)]
    assert images[0].getpixel((3, 3)) == (255, 0, 0) and images[1].getpixel((3, 3)) == (0, 0, 255)
    # the trainer's re-processing gives the pixels the processor gave the prompt
    again = proc.process_images(images)
    assert again is not None and again.pixel_values.equal(mm.pixel_values)


def test_bad_image_names_row_and_field(vl_dir: str, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "a", "label": "1", "images": []})
        + "\n"
        + json.dumps({"prompt": "b", "label": "1", "images": [str(tmp_path / "missing.png")]})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: field 'images' \(image 0\)"):
        _dataset(vl_dir, data)


def test_multimodal_keys_need_a_processor(vl_dir: str, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "label": "1"}) + "\n")
    tok = AutoTokenizer.from_pretrained(vl_dir)
    with pytest.raises(ValueError, match="--multimodal-keys"):
        PromptDataset(data, "prompt", "label", None, tok, False, multimodal_keys={"image": "images"})
