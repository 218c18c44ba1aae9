"""HF export of a vision-language model (issue 27): `export_sharded_model` (--save-hf) and `convert_checkpoint`
(convert_to_hf) of a trained tiny Qwen2.5-VL / Qwen3-VL write directories that transformers loads as the VL model,
with the processor files, giving the trained model's logits on a prompt with an image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from miles.backends.fsdp_utils.hf_export import convert_checkpoint, export_sharded_model
from miles.rollout.multimodal import VLProcessor
from miles.tools.tiny_vlm import build_tiny_vlm


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=2))


def _trained(path: str) -> torch.nn.Module:
    """The model with every weight moved (as a train step would), so an export of the original would differ."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _logits(model: torch.nn.Module, path: str) -> torch.Tensor:
    proc = VLProcessor.from_pretrained(path)
    img = Image.new("RGB", (70, 60), (30, 90, 200))
    ImageDraw.Draw(img).ellipse((5, 5, 40, 40), fill=(255, 255, 255))
    ids, mm = proc.encode("count", [img])
    assert mm is not None
    tokens = torch.tensor(ids)[None]
    with torch.no_grad():
        return model(
            input_ids=tokens,
            pixel_values=mm.pixel_values,
            image_grid_thw=mm.image_grid_thw,
            mm_token_type_ids=(tokens == proc.image_token_id).int(),
        ).logits


def _load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def test_save_hf_and_convert_load_as_the_vl_model(vl_dir: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = _trained(vl_dir)
    expected = _logits(model, vl_dir)
    assert not torch.allclose(expected, _logits(_load(Path(vl_dir)), vl_dir))  # the weights did move

    saved = export_sharded_model(model, tmp_path / "hf", vl_dir, torch.float32, bucket_bytes=1 << 16)
    iter_dir = tmp_path / "iter_0000000"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(iter_dir), no_dist=True)
    converted = convert_checkpoint(iter_dir, tmp_path / "conv", hf_source=vl_dir)
    for out in (saved, converted):
        assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
        loaded = _load(out)
        assert type(loaded) is type(model)
        torch.testing.assert_close(_logits(loaded, str(out)), expected, atol=1e-6, rtol=0)
