"""A packed VL forward equals each sample's own forward: tiny Qwen2.5-VL and Qwen3-VL, fp32 CPU, log-probs and
gradients (vision tower included) within 1e-5; the pack holds a sample with two images, one without images and
one with one image (issue 27)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.vl_packing import forward_packed_vl, pack_images, vision_tower
from miles.rollout.multimodal import VLProcessor
from miles.tools.tiny_vlm import build_tiny_vlm

TOL = 1e-5


def _image(w: int, h: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    img = Image.new("RGB", (w, h), tuple(int(x) for x in torch.randint(0, 255, (3,), generator=g)))
    d = ImageDraw.Draw(img)
    d.ellipse((5, 5, w // 2, h // 2), fill=(255, 255, 255))
    return img


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=1))


def _samples(proc: VLProcessor) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    specs = [
        ("count 3 + 4", [_image(60, 50, 1), _image(112, 56, 2)]),  # two images of different grids
        ("what is 2 + 2", []),  # text only
        ("count 1", [_image(80, 80, 3)]),
    ]
    out = []
    for text, images in specs:
        ids, mm = proc.encode(text, images)
        resp = torch.randint(10, 40, (5,), generator=g).tolist()
        out.append({"tokens": ids + resp, "response_length": len(resp), "multimodal_inputs": mm})
    return out


def _model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).train()


def _reference(model: torch.nn.Module, sample: dict) -> torch.Tensor:
    """The sample's response log-probs from its own forward (HF's own attention and position ids)."""
    tokens = torch.tensor(sample["tokens"])[None]
    kwargs = {}
    mm = sample["multimodal_inputs"]
    if mm is not None:
        kwargs = dict(
            pixel_values=mm.pixel_values,
            image_grid_thw=mm.image_grid_thw,
            mm_token_type_ids=(tokens == model.config.image_token_id).int(),
        )
    logits = model(input_ids=tokens, use_cache=False, **kwargs).logits[0]
    r = sample["response_length"]
    lp = torch.log_softmax(logits[-r - 1 : -1].float(), dim=-1)
    return lp.gather(-1, tokens[0, -r:, None])[:, 0]


def test_processor_places_one_pad_per_merged_patch(vl_dir: str) -> None:
    proc = VLProcessor.from_pretrained(vl_dir)
    ids, mm = proc.encode("count 3", [_image(60, 50, 1), _image(112, 56, 2)])
    assert mm is not None and mm.num_images == 2
    expected = int((mm.image_grid_thw.prod(-1) // 4).sum())
    assert sum(1 for t in ids if t == proc.image_token_id) == expected
    assert mm.pixel_values.shape[0] == int(mm.image_grid_thw.prod(-1).sum())


def test_packed_equals_per_sample_forward_and_backward(vl_dir: str) -> None:
    proc = VLProcessor.from_pretrained(vl_dir)
    samples = _samples(proc)
    ref_model, packed_model = _model(vl_dir), _model(vl_dir)
    weights = [torch.linspace(0.5, 1.5, s["response_length"]) * (i + 1) for i, s in enumerate(samples)]

    ref = [_reference(ref_model, s) for s in samples]
    sum((lp * w).sum() for lp, w in zip(ref, weights)).backward()

    (packed,) = pack_sequences(samples, num_packs=1)
    images = pack_images(packed, samples)
    assert images.images_per_sequence == [2, 0, 1]
    lps, _ = forward_packed_vl(packed_model, packed, images, temperature=1.0)
    sum((lp * weights[i]).sum() for lp, i in zip(lps, packed.sample_indices.tolist())).backward()

    for lp, i in zip(lps, packed.sample_indices.tolist()):
        torch.testing.assert_close(lp, ref[i].detach(), atol=TOL, rtol=0)
    ref_params = dict(ref_model.named_parameters())
    vision_grads = 0
    for name, p in packed_model.named_parameters():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=TOL, rtol=1e-4, msg=name)
            vision_grads += name.startswith("model.visual.") and bool(p.grad.abs().sum() > 0)
    assert vision_grads > 0  # the images reached the loss through the vision tower


def test_images_change_the_log_probs(vl_dir: str) -> None:
    """Not a vacuous pass: the same tokens with other pixels give other log-probs."""
    proc = VLProcessor.from_pretrained(vl_dir)
    samples = _samples(proc)
    model = _model(vl_dir)
    (packed,) = pack_sequences(samples, num_packs=1)
    images = pack_images(packed, samples)
    with torch.no_grad():
        a, _ = forward_packed_vl(model, packed, images, 1.0)
        assert images.pixel_values is not None
        images.pixel_values = images.pixel_values.flip(0)
        b, _ = forward_packed_vl(model, packed, images, 1.0)
    assert (a[0] - b[0]).abs().max() > 1e-4
    assert vision_tower(model) is model.model.visual
