"""Refit names of VL models (issue 27): the spelling SGLang's Qwen-VL loaders take; the embedded engine takes both."""

from __future__ import annotations

import pytest

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


def _sglang_model_file(name: str) -> str | None:
    """The path of SGLang's `srt/models/<name>.py` in the conformance venv (MILES_SGLANG_VENV), None without."""
    import glob
    import os

    venv = os.environ.get("MILES_SGLANG_VENV", "/work/venvs/sglang")
    found = glob.glob(
        os.path.join(venv, "lib", "python3*", "site-packages", "sglang", "srt", "models", f"{name}.py")
    )
    return found[0] if found else None


def _attributes_and_mapping(
    path: str, classes: tuple[str, str]
) -> tuple[set[str], set[str], list[tuple[str, str]]]:
    """Read statically (ast; instantiating SGLang's model stalls on CPU): the `self.X = ...` attributes of the top
    class's and the vision class's `__init__`, and the (param_name, shard_name) pairs of the top class's
    `load_weights` `stacked_params_mapping`."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    attrs: dict[str, set[str]] = {c: set() for c in classes}
    mapping: list[tuple[str, str]] = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name not in classes:
            continue
        for fn in node.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            for sub in ast.walk(fn):
                if fn.name == "__init__" and isinstance(sub, ast.Assign):
                    for t in sub.targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            attrs[node.name].add(t.attr)
                if (
                    fn.name == "load_weights"
                    and node.name == classes[0]
                    and isinstance(sub, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "stacked_params_mapping" for t in sub.targets)
                ):
                    mapping = [(e.elts[0].value, e.elts[1].value) for e in sub.value.elts]  # type: ignore[attr-defined]
    return attrs[classes[0]], attrs[classes[1]], mapping


SGLANG_VL_CLASSES = {
    "qwen2_5_vl": ("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VisionTransformer")),
    "qwen3_vl": ("qwen3_vl", ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeVisionModel")),
}


@pytest.mark.parametrize("kind", sorted(SGLANG_VL_CLASSES))
def test_refit_names_match_the_installed_sglang_vl_loaders(tmp_path, kind: str) -> None:
    """Every tensor the refit sends for a tiny VL model lands in SGLang 0.5.23's loader: after the loader's own
    stacked-name mapping, its first component is an attribute of SGLang's model class (`model`, `visual`,
    `lm_head`), a vision name's second an attribute of SGLang's vision class, and every q/k/v/gate/up shard of
    the language model is one the loader stacks."""
    from transformers import AutoModelForImageTextToText

    from miles.tools.tiny_vlm import build_tiny_vlm

    module, classes = SGLANG_VL_CLASSES[kind]
    path = _sglang_model_file(module)
    if path is None:
        pytest.skip("SGLang is not installed (set MILES_SGLANG_VENV)")
    top, vision, mapping = _attributes_and_mapping(path, classes)
    assert {"model", "visual", "lm_head"} <= top and {"patch_embed", "blocks", "merger"} <= vision
    assert {s for _, s in mapping} >= {".q_proj", ".k_proj", ".v_proj", "up_proj", "gate_proj"}
    model = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(tmp_path / "vl", kind))
    sent = [e.name for e in hf_tensors(model, None)]
    stacked = 0
    for name in sent:
        first, second = name.split(".")[:2]
        assert first in top, name
        if first == "visual":
            assert second in vision, name
        else:
            assert first != "model" or second in {"embed_tokens", "layers", "norm"}, name
            stacked += any(shard in name for _, shard in mapping)
    assert stacked >= 5 * model.config.text_config.num_hidden_layers  # q, k, v, gate, up of every layer
