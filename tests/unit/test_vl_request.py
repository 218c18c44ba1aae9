"""The image part of /generate requests (miles.rollout.vl_request): one `<|image_pad|>` per image in `input_ids`,
the images as `image_data` (a list for one request, a list of lists for a batch). Against SGLang's own request
normalization and pad expansion: tests/integration/test_sglang_vl_conformance.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from miles.rollout.generate_batching import batching
from miles.rollout.generate_client import GenerateClient
from miles.rollout.vl_request import collapse_image_pads, engine_prompt, image_data_field

PAD, START, END = 9, 7, 8
URI_A, URI_B = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"


class _Tok:
    unk_token_id = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        return PAD if token == "<|image_pad|>" else 0


def _sample(tokens, images, response_length=0, index=3):
    mm = None if images is None else {"image": images}
    return SimpleNamespace(tokens=tokens, response_length=response_length, index=index, multimodal_data=mm)


def test_collapse_counts_runs():
    assert collapse_image_pads([1, START, PAD, PAD, PAD, END, START, PAD, END, 2], PAD) == (
        [1, START, PAD, END, START, PAD, END, 2],
        2,
    )
    assert collapse_image_pads([1, 2], PAD) == ([1, 2], 0)


def test_engine_prompt_collapses_only_the_prompt():
    tokens = [1, START, PAD, PAD, END, START, PAD, PAD, PAD, END, 4, PAD, PAD]  # last 2: a partial response
    ids, images = engine_prompt(_sample(tokens, [URI_A, URI_B], response_length=2), _Tok())
    assert ids == [1, START, PAD, END, START, PAD, END, 4, PAD, PAD] and images == [URI_A, URI_B]


def test_engine_prompt_collapses_tool_result_images_in_the_response():
    """A multi-turn sample: one image in the prompt, one in a tool result inside the response, then pads the
    policy sampled: the two image runs are collapsed (one pad each), the sampled pads go as they are."""
    tokens = [1, START, PAD, PAD, END, 7, 8, START, PAD, PAD, PAD, END, 9, PAD, PAD]
    ids, images = engine_prompt(_sample(tokens, [URI_A, URI_B], response_length=10), _Tok())
    assert ids == [1, START, PAD, END, 7, 8, START, PAD, END, 9, PAD, PAD] and images == [URI_A, URI_B]


def test_text_only_sample_goes_unchanged():
    tokens = [1, 2, 3]
    assert engine_prompt(_sample(tokens, None), _Tok()) == ([1, 2, 3], None)
    assert engine_prompt(_sample(tokens, []), _Tok()) == ([1, 2, 3], None)
    assert engine_prompt(SimpleNamespace(tokens=tokens, response_length=0, index=0), _Tok()) == (
        [1, 2, 3],
        None,
    )


def test_image_count_mismatch_names_the_sample():
    with pytest.raises(ValueError, match="sample 3: its tokens have 1 runs"):
        engine_prompt(_sample([START, PAD, END], [URI_A, URI_B]), _Tok())
    with pytest.raises(ValueError, match="video"):
        engine_prompt(
            SimpleNamespace(tokens=[1], response_length=0, index=3, multimodal_data={"video": []}), _Tok()
        )


def test_image_data_field_shapes():
    assert image_data_field([None], single=True) == {}
    assert image_data_field([None, []], single=False) == {}
    assert image_data_field([[URI_A, URI_B]], single=True) == {"image_data": [URI_A, URI_B]}
    assert image_data_field([None, [URI_A]], single=False) == {"image_data": [[], [URI_A]]}


def _capture(bodies):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return httpx.Response(404 if request.url.path == "/workers" else 200)
        body = json.loads(request.content)
        bodies.append(body)
        n = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 0
        one = {"text": "x", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}}}
        return httpx.Response(200, json=[one] * n if n else one)

    return httpx.MockTransport(handler)


def test_client_sends_image_data_single_and_batch():
    bodies: list[dict] = []

    async def go():
        async with GenerateClient(
            "http://r:1", ["http://e:1"], None, 5.0, 4, transport=_capture(bodies)
        ) as c:
            await c.generate([START, PAD, END], {"max_new_tokens": 1}, 0, "rollout", image_data=[URI_A])
            await c.generate([1, 2], {"max_new_tokens": 1}, 1, "rollout")
            with batching("group"):
                await asyncio.gather(
                    c.generate([1], {"max_new_tokens": 1}, 2, "rollout", rid="a"),
                    c.generate(
                        [START, PAD, END], {"max_new_tokens": 1}, 3, "rollout", rid="b", image_data=[URI_B]
                    ),
                )

    asyncio.run(go())
    assert bodies[0]["image_data"] == [URI_A] and bodies[0]["input_ids"] == [START, PAD, END]
    assert "image_data" not in bodies[1]
    assert bodies[2]["image_data"] == [[], [URI_B]] and bodies[2]["input_ids"] == [[1], [START, PAD, END]]
