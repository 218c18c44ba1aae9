"""Images in /generate requests against SGLang 0.5.23's own code (the conformance venv, as
test_sglang_conformance.py): the body miles sends (miles.rollout.vl_request) is accepted by SGLang's
`GenerateReqInput` normalization with the images where each request's processor looks for them, and SGLang's
`BaseMultimodalProcessor._expand_input_ids` (one placeholder per image, expanded to the image's token count)
turns the request's ids back into exactly the sample's processor-expanded ids."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS_PYTHON = ROOT / "tests" / "sglang_conformance" / "python"
VENV = Path(os.environ.get("MILES_SGLANG_VENV", ROOT / ".venv-sglang"))

pytestmark = pytest.mark.side_venv(VENV, ".miles-sglang-ok", "bash scripts/sglang-venv.sh")

CHECK = r"""
import json, sys
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor as P
case = json.load(sys.stdin)
out = {}
single = GenerateReqInput(**case["single"])
single.normalize_batch_and_arguments()
out["single"] = {"is_single": single.is_single, "image_data": single.image_data,
                 "expanded": P._expand_input_ids(single.input_ids, case["counts"], case["pad"])}
batch = GenerateReqInput(**case["batch"])
batch.normalize_batch_and_arguments()
out["batch"] = {"is_single": batch.is_single, "n": batch.batch_size,
                "per_request": [batch[i].image_data for i in range(batch.batch_size)],
                "input_ids": [batch[i].input_ids for i in range(batch.batch_size)]}
print(json.dumps(out))
"""


def _harness(code: str, stdin: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MILES_SGLANG_VENV": str(VENV)}
    return subprocess.run(
        [str(HARNESS_PYTHON), "-c", code], input=stdin, capture_output=True, text=True, env=env, timeout=300
    )


def _png_uri(color: tuple[int, int, int], size: tuple[int, int]) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_request_shape_matches_sglang(tmp_path):
    from miles.rollout.multimodal import VLProcessor, load_image
    from miles.rollout.vl_request import engine_prompt, image_data_field
    from miles.tools.tiny_vlm import build_tiny_vlm

    proc = VLProcessor.from_pretrained(str(build_tiny_vlm(tmp_path / "vl", "qwen2_5_vl")))
    uris = [_png_uri((200, 10, 10), (64, 80)), _png_uri((10, 10, 200), (112, 100))]
    ids, mm = proc.encode("how many?", [load_image(u, "test") for u in uris])
    assert mm is not None
    counts = (mm.image_grid_thw.prod(-1) // proc.merge_size**2).tolist()
    sample = SimpleNamespace(tokens=ids, response_length=0, index=0, multimodal_data={"image": uris})
    req_ids, images = engine_prompt(sample, proc.tokenizer)
    text_ids = proc.tokenizer("plain", add_special_tokens=False)["input_ids"]
    params = {"max_new_tokens": 4}
    case = {
        "single": {
            "input_ids": req_ids,
            "sampling_params": params,
            **image_data_field([images], single=True),
        },
        "batch": {
            "input_ids": [text_ids, req_ids],
            "sampling_params": [params, params],
            **image_data_field([None, images], single=False),
        },
        "counts": counts,
        "pad": proc.image_token_id,
    }
    out = _harness(CHECK, json.dumps(case))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["single"]["is_single"] and got["single"]["image_data"] == uris
    assert got["single"]["expanded"] == ids  # SGLang's expansion of our request = the sample's own ids
    assert sum(t == proc.image_token_id for t in req_ids) == 2 and len(req_ids) < len(ids)
    assert got["batch"] == {
        "is_single": False,
        "n": 2,
        "per_request": [[], uris],
        "input_ids": [text_ids, req_ids],
    }
