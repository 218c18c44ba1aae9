"""Multi-turn VL (issue 27 item 6): a tool answer that carries an image (a DeepEyes-style crop tool) over a tiny
Qwen-VL model served by the embedded engine: the image joins the sample's images, its tokens are masked from the
loss, the next request carries all images, and the trainer's packed VL forward gives the engine's log-probs."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import pytest
import torch

from miles.rollout.base_types import GenerateContext, MultiTurnSettings, SamplingSettings
from miles.rollout.generate_client import GenerateClient
from miles.rollout.multi_turn import generate_multi_turn
from miles.rollout.multimodal import VLProcessor, images_of_sample, load_image
from miles.utils.types import Sample, SampleStatus

TOOL_TOKENS = ["<tool_call>", "</tool_call>"]


def _uri(size, box):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (240, 240, 240))
    ImageDraw.Draw(image).rectangle(box, fill=(200, 30, 30))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PROMPT_IMAGE = _uri((84, 70), (10, 10, 40, 30))


def crop_tool(arguments, sample):
    """Zoom into the top-left half of the sample's first image."""
    image = load_image(sample.multimodal_data["image"][0], "crop")
    return {"text": f"zoomed {arguments}", "images": [image.crop((0, 0, 42, 35)).resize((70, 56))]}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def served(request, tmp_path_factory):
    import miles.tools.tiny_vlm as tiny_vlm
    from miles.engines.local.engine import LocalEngine, LocalEngineConfig
    from miles.engines.local.server import create_app
    from miles.tools.tiny_model import build_tokenizer

    def with_tool_tokens(task, vocab_size):
        tok = build_tokenizer(task, vocab_size, extra_special_tokens=[*tiny_vlm.VISION_TOKENS, *TOOL_TOKENS])
        tok.chat_template = tiny_vlm.VL_CHAT_TEMPLATE
        return tok

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_vlm, "build_vl_tokenizer", with_tool_tokens)
        path = str(tiny_vlm.build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=2))
    eng = LocalEngine(LocalEngineConfig(model_path=path, max_running_requests=2))
    eng.start()
    yield path, eng, create_app(eng, request_timeout=60, admin_timeout=30)
    eng.stop()


class _Recording(httpx.AsyncBaseTransport):
    def __init__(self, app, bodies):
        self.inner, self.bodies = httpx.ASGITransport(app=app), bodies

    async def handle_async_request(self, request):
        if request.url.path == "/generate":
            self.bodies.append(json.loads(request.content))
        return await self.inner.handle_async_request(request)


def test_tool_image_is_masked_sent_and_trained_at_engine_log_probs(served, monkeypatch):
    import miles.engines.local.engine_loop as engine_loop
    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.vl_packing import forward_packed_vl, pack_images

    path, _, app = served
    proc = VLProcessor.from_pretrained(path)
    tok = proc.tokenizer
    call = tok.convert_tokens_to_ids(TOOL_TOKENS)
    forced = [call[0], *tok("1", add_special_tokens=False)["input_ids"], call[1]]
    forced_turn = list(forced)
    original = engine_loop.sample_batch

    def forcing(logits, params, rngs):  # the first turn calls the tool; later tokens are sampled
        tokens, lps = original(logits, params, rngs)
        if forced:
            t = forced.pop(0)
            tokens, lps = [t] * len(tokens), torch.log_softmax(logits.float(), -1)[:, t].tolist()
        return tokens, lps

    monkeypatch.setattr(engine_loop, "sample_batch", forcing)
    ids, _ = proc.encode("count", [load_image(PROMPT_IMAGE, "t")])
    sample = Sample(index=3, tokens=list(ids), multimodal_data={"image": [PROMPT_IMAGE]})
    settings = MultiTurnSettings(max_turns=2, tool=crop_tool, tool_timeout=30.0, tool_name="crop")
    ctx = GenerateContext(tokenizer=tok, request_id_prefix="rollout1", multi_turn=settings)
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=40)
    bodies: list[dict] = []

    async def go() -> Sample:
        url = "http://engine"
        async with GenerateClient(url, [url], None, 60.0, 8, transport=_Recording(app, bodies)) as client:
            return await generate_multi_turn(client, sample, sampling, ctx)

    out = asyncio.run(go())
    assert out.metadata["tool_calls"] == 1 and out.metadata["turns"] == 2
    assert out.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    # the tool answer: masked exactly, the crop's pads expanded by the image processor, inside the template
    images = images_of_sample(out.multimodal_data, "t")
    assert len(images) == 2 and out.multimodal_data["image"][0] == PROMPT_IMAGE
    mm = proc.process_images(images)
    crop_pads = int(mm.image_grid_thw[1].prod()) // proc.merge_size**2
    response = out.tokens[len(ids) :]
    first = out.loss_mask.index(0)  # the forced first turn: the tool call (its stop string trimmed)
    assert response[:2] == forced_turn[:2]
    tool_len = out.loss_mask.index(1, first) - first
    assert out.response_length - first - tool_len >= 1  # the second turn's model tokens
    assert out.loss_mask == [1] * first + [0] * tool_len + [1] * (out.response_length - first - tool_len)
    tool_part = response[first : first + tool_len]
    assert tool_part.count(proc.image_token_id) == crop_pads and crop_pads > 1
    text = tok.decode(tool_part)
    assert text.startswith(tok.eos_token) and "<|vision_end|>" in text and " 1<|im_end|>" in text  # lossy BPE
    assert text.endswith("assistant\n")
    assert all(lp == 0.0 for lp in out.rollout_log_probs[first : first + tool_len])
    # the second request carries both images, each image's pad run collapsed to one pad
    assert len(bodies) == 2 and bodies[0]["image_data"] == [PROMPT_IMAGE]
    assert bodies[1]["image_data"] == out.multimodal_data["image"]
    assert bodies[1]["input_ids"].count(proc.image_token_id) == 2
    # the trainer's packed VL forward over the whole sample = the engine's log-probs on the model's tokens
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    rows = [{"tokens": out.tokens, "response_length": out.response_length, "multimodal_inputs": mm}]
    (packed,) = pack_sequences(rows, num_packs=1)
    with torch.no_grad():
        (got,), _ = forward_packed_vl(model, packed, pack_images(packed, rows), temperature=1.0)
    trained = torch.tensor(out.loss_mask, dtype=torch.bool)
    diff = (got[trained] - torch.tensor(out.rollout_log_probs)[trained]).abs().max().item()
    print(f"max |engine - trainer| log-prob: {diff:.2e}")
    assert diff <= 1e-5, diff


def test_tool_images_need_a_vision_language_checkpoint():
    from miles.rollout.multi_turn import ToolAnswer, tool_answer_ids
    from miles.tools.tiny_model import build_tokenizer

    tok = build_tokenizer("echo10", 48)
    with pytest.raises(ValueError, match="--generate-execute-tool-function-path.*issue 27"):
        tool_answer_ids(tok, ToolAnswer("x", [PROMPT_IMAGE]), True, "rollout generate: sample index 0")
    with pytest.raises(ValueError, match="expected a str or a dict"):
        from miles.rollout.multi_turn import _answer_of

        _answer_of({"text": "x", "image": []}, "tool t")
