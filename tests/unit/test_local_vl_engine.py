"""The embedded engine serves the tiny Qwen2.5-VL and Qwen3-VL models (miles.engines.local.vl_runner): a request
shaped as for SGLang (one `<|image_pad|>` per image in `input_ids`, `image_data` the images) generates the greedy
tokens and log-probs of HF's own `generate` on the same images and prompt (<= 1e-5), with two images in one
request, a text-only request in the same batch, and requests decoding side by side (one HF cache per slot)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest
import torch

from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.engines.local.vl_runner import VLInputs, VLRunner
from miles.rollout.multimodal import VLProcessor, load_image
from miles.rollout.vl_request import collapse_image_pads
from miles.tools.tiny_vlm import build_tiny_vlm

NEW = 6


def _uri(color, size):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    Image.open(io.BytesIO(buf.getvalue()))
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = [_uri((220, 30, 30), (64, 90)), _uri((20, 40, 200), (112, 84))]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl(request, tmp_path_factory):
    path = str(build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=1))
    eng = LocalEngine(LocalEngineConfig(model_path=path, max_running_requests=4))
    eng.start()
    yield path, eng
    eng.stop()


def _hf_greedy(path, ids, mm):
    """Greedy tokens and their log-probs from HF's generate on the processor's expanded ids."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    extra = {}
    if mm is not None:
        pad = model.config.image_token_id
        extra = dict(
            pixel_values=mm.pixel_values, image_grid_thw=mm.image_grid_thw, mm_token_type_ids=(x == pad).int()
        )
    out = model.generate(
        x, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True, **extra
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, lps


def _run(eng, body):
    _, futs, batch = eng.submit_generate(body)
    outs = [f.result(120) for f in futs]
    return outs if batch else outs[0]


def test_engine_equals_hf_generate_with_images_and_text(vl):
    path, eng = vl
    proc = VLProcessor.from_pretrained(path)
    ids, mm = proc.encode("count the shapes", [load_image(u, "t") for u in IMAGES])
    text_ids, _ = proc.encode("what is 3+4?", [])
    sent, runs = collapse_image_pads(ids, proc.image_token_id)
    assert runs == 2
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    outs = _run(
        eng,
        {
            "input_ids": [sent, text_ids],
            "image_data": [IMAGES, []],
            "sampling_params": [sp, sp],
            "return_logprob": True,
        },
    )
    for out, (p_ids, p_mm) in zip(outs, [(ids, mm), (text_ids, None)]):
        want_tokens, want_lps = _hf_greedy(path, p_ids, p_mm)
        assert out["output_ids"] == want_tokens
        got_lps = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_lps, want_lps)) <= 1e-5
        assert out["meta_info"]["prompt_tokens"] == len(p_ids)  # SGLang counts the expanded prompt
    single = _run(
        eng, {"input_ids": sent, "image_data": IMAGES, "sampling_params": sp, "return_logprob": True}
    )
    assert single["output_ids"] == outs[0]["output_ids"]


def test_image_count_must_match_pads(vl):
    path, eng = vl
    proc = VLProcessor.from_pretrained(path)
    ids, _ = proc.encode("x", [load_image(IMAGES[0], "t")])
    sent, _ = collapse_image_pads(ids, proc.image_token_id)
    with pytest.raises(ValueError, match="1 image placeholder token.* but 2 image"):
        eng.submit_generate(
            {"input_ids": sent, "image_data": IMAGES, "sampling_params": {"max_new_tokens": 1}}
        )
    assert eng.model_info()["has_image_understanding"] is True


def test_sampled_image_pads_mid_response_are_text_for_engine_and_trainer(vl, monkeypatch):
    """A response holding image pads and a vision start mid-way (as a policy may sample them): the engine keeps
    decoding (the tokens are text at text positions + the rope delta, as SGLang decodes) and the trainer's packed
    forward gives the engine's log-probs (<= 1e-5), for a sample with an image and one without."""
    import miles.engines.local.engine_loop as engine_loop
    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.vl_packing import forward_packed_vl, pack_images

    path, eng = vl
    proc = VLProcessor.from_pretrained(path)
    cfg = eng.runner.model.config
    forced = {1: cfg.image_token_id, 2: cfg.vision_start_token_id, 4: cfg.image_token_id}
    original = engine_loop.sample_batch
    step = {"n": 0}

    def forcing(logits, params, rngs):
        tokens, lps = original(logits, params, rngs)
        tok = forced.get(step["n"])
        step["n"] += 1
        if tok is not None:
            tokens = [tok] * len(tokens)
            lps = torch.log_softmax(logits.float(), -1)[:, tok].tolist()
        return tokens, lps

    monkeypatch.setattr(engine_loop, "sample_batch", forcing)
    ids, mm = proc.encode("count the shapes", [load_image(IMAGES[1], "t")])
    text_ids, _ = proc.encode("what is 3+4?", [])
    sent, _ = collapse_image_pads(ids, proc.image_token_id)
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    samples = []
    for prompt, expanded, images, p_mm in [(sent, ids, IMAGES[1:], mm), (text_ids, text_ids, [], None)]:
        step["n"] = 0
        out = _run(
            eng, {"input_ids": prompt, "image_data": images, "sampling_params": sp, "return_logprob": True}
        )
        assert [out["output_ids"][k] for k in forced] == list(forced.values())
        lps = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
        samples.append(
            {
                "tokens": expanded + out["output_ids"],
                "response_length": NEW,
                "multimodal_inputs": p_mm,
                "lps": lps,
            }
        )
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    (packed,) = pack_sequences(samples, num_packs=1)
    with torch.no_grad():
        got, _ = forward_packed_vl(model, packed, pack_images(packed, samples), temperature=1.0)
    for lp, i in zip(got, packed.sample_indices.tolist()):
        assert (lp - torch.tensor(samples[i]["lps"])).abs().max() <= 1e-5
    # a re-prefill of prompt and outputs (a slot whose cache is gone) reads the pads as text too
    runner = VLRunner(model)
    inputs = VLInputs(mm.pixel_values, mm.image_grid_thw)
    logits = runner._prefill(0, SimpleNamespace(mm=inputs, input_ids=ids), samples[0]["tokens"][:-1])
    last = torch.log_softmax(logits, -1)[samples[0]["tokens"][-1]].item()
    assert abs(last - samples[0]["lps"][-1]) <= 1e-5
