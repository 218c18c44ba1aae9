"""Refit names of VL models (issue 27): the spelling SGLang's Qwen-VL loaders take; the embedded engine takes both."""

from __future__ import annotations

from miles.refit.buckets import hf_tensors
from miles.refit.vl_names import engine_name


def test_engine_names_of_qwen_vl_tensors() -> None:
    assert (
        engine_name("model.language_model.layers.0.self_attn.q_proj.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert engine_name("model.visual.blocks.1.attn.qkv.weight") == "visual.blocks.1.attn.qkv.weight"
    assert engine_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert engine_name("lm_head.weight") == "lm_head.weight"
    assert (
        engine_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )  # text-only


def test_refit_sends_and_engine_loads_vl_names(tmp_path) -> None:
    from transformers import AutoModelForImageTextToText

    from miles.engines.local.weights import WeightStore
    from miles.tools.tiny_vlm import build_tiny_vlm

    model = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(tmp_path / "vl", "qwen2_5_vl"))
    sent = [e.name for e in hf_tensors(model, None)]
    assert not [n for n in sent if n.startswith(("model.language_model.", "model.visual."))]
    assert any(n.startswith("visual.blocks.") for n in sent) and any(
        n.startswith("model.layers.") for n in sent
    )
    store = WeightStore(model)
    assert {store.resolve(n) for n in sent} == set(
        store.names
    )  # every parameter reached, under SGLang's names
