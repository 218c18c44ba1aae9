"""The shared-memory weight window between trainer and embedded engine (miles.refit.window_layout,
miles.engines.local.window, miles.refit.window), in one process: layout, writes into the engine's fused blocks, the
engine pointing its parameters at the window without a copy, and every refusal."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.refit.window import TrainerWindow
from miles.refit.window_layout import WINDOW_PREFIX, WindowLayout
from miles.tools.tiny_model import build_word_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_word_model(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=True)
    eng = LocalEngine(LocalEngineConfig(model_path=str(path), max_running_requests=2, max_total_tokens=40))
    eng.start()
    yield eng, str(path)
    eng.stop()


def _op(eng: LocalEngine, name: str, **kw):
    return eng.run(name, **kw).result(30)


def _greedy(eng: LocalEngine) -> list[int]:
    _, futs, _ = eng.submit_generate(
        {
            "input_ids": [3, 4, 5],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        }
    )
    return futs[0].result(30)["output_ids"]


def _trainer_state(path: str, seed: int) -> dict[str, torch.Tensor]:
    """A model's tensors as a trainer sends them: state-dict order, tied tensors once, moved by `seed`."""
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    out, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach() + 0.01 * torch.randn(t.shape, generator=g)
    return out


def test_layout_round_trip_and_fused_blocks(engine):
    eng, _ = engine
    layout = WindowLayout.from_json(_op(eng, "weight_window_layout")["layout"])
    assert WindowLayout.from_json(layout.to_json()).digest() == layout.digest()
    tampered = layout.to_json()
    tampered["entries"][0]["offset"] += 1
    with pytest.raises(ValueError, match="digest"):
        WindowLayout.from_json(tampered)
    by_name = {e.name: e for e in layout.entries}
    q, k = (
        by_name["model.layers.0.self_attn.q_proj.weight"],
        by_name["model.layers.0.self_attn.k_proj.weight"],
    )
    assert q.stride == k.stride == (q.shape[1], 1)  # row blocks of one [q+k+v, in] region
    assert k.offset == q.offset + q.shape[0] * q.shape[1]
    assert layout.aliases["lm_head.weight"] == layout.aliases["model.embed_tokens.weight"]  # tied
    ends = sorted(
        (e.offset, e.offset + max(s * (n - 1) for s, n in zip(e.stride, e.shape)) + 1) for e in layout.entries
    )
    assert ends[-1][1] <= layout.numel


def test_window_refit_is_bit_equal_without_copy_across_steps(engine, tmp_path):
    eng, path = engine
    layout = WindowLayout.from_json(_op(eng, "weight_window_layout")["layout"])
    window = TrainerWindow(layout)
    assert os.path.basename(window.path).startswith(WINDOW_PREFIX)
    full = eng.weights.allocated_bytes()
    try:
        for step in range(3):
            state = _trainer_state(path, seed=step)
            window.check_covers([(n, tuple(t.shape)) for n, t in state.items()])
            _op(eng, "release_memory_occupation", tags=["weights"])
            for name, t in state.items():
                window.views[name].copy_(t)
            _op(eng, "resume_memory_occupation", tags=["weights"])
            # once the weights are window views, resuming fills nothing: the refit points them at views again
            assert eng.weights.allocated_bytes() == (0 if step else full)
            answer = _op(eng, "update_weights_from_window", path=window.path, layout_digest=layout.digest(),
                         weight_version=f"w{step}")  # fmt: skip
            assert answer["weight_version"] == f"w{step}" and not eng.session_open
            qkv = eng.runner.layers[0].qkv
            assert (
                qkv._orientation() == "rows"
            )  # the window's blocks are used as they are, not laid out again
            assert (
                qkv.weight()[0].data_ptr()
                == eng._window.views["model.layers.0.self_attn.q_proj.weight"].data_ptr()
            )
            for name, t in state.items():
                live = eng.weights.get(name)
                assert torch.equal(live, t), name
                # a view of the engine's mapping of the window, not a copy: a write by the trainer shows
                assert live.data_ptr() == eng._window.views[layout.aliases[name]].data_ptr(), name
            name, t = next(iter(state.items()))
            window.views[name].add_(1.0)
            assert torch.equal(eng.weights.get(name), t + 1.0)
            window.views[name].copy_(t)
            assert eng.model_info()["weight_version"] == f"w{step}"
            via_window = _greedy(eng)
            # the same weights loaded by copy give the same tokens (the fused blocks are used as they are)
            _op(eng, "begin_weight_update")
            eng.weights.load(list(state.items()))
            _op(eng, "end_weight_update")
            assert _greedy(eng) == via_window
    finally:
        window.close()
    assert not os.path.exists(window.path)


def test_window_load_resumes_and_answers_checksums_in_one_call(engine):
    """`resume_tags` are resumed before the load (a tag not released is refused, nothing loaded); `checksums`
    puts /weights_checker's answer into the load's, the same checksums a separate call gives."""
    eng, path = engine
    layout = WindowLayout.from_json(_op(eng, "weight_window_layout")["layout"])
    window = TrainerWindow(layout)
    load = {"path": window.path, "layout_digest": layout.digest()}
    try:
        for name, t in _trainer_state(path, seed=5).items():
            window.views[name].copy_(t)
        plain = _op(eng, "update_weights_from_window", weight_version="r0", **load)
        assert "ranks" not in plain and "checksum_seconds" not in plain
        _op(eng, "release_memory_occupation", tags=["weights", "kv_cache"])
        assert eng.released_tags == {"weights", "kv_cache"} and eng.kv_released
        answer = _op(eng, "update_weights_from_window", weight_version="r1", resume_tags=["weights", "kv_cache"],
                     checksums=True, **load)  # fmt: skip
        assert answer["weight_version"] == "r1" and not eng.released_tags and not eng.kv_released
        separate = _op(eng, "weights_checker", action="checksum")
        assert answer["ranks"] == separate["ranks"] and answer["ranks"][0]["checksums"]
        assert answer["per_engine_checksum"] == separate["per_engine_checksum"]
        assert answer["checksum_seconds"] >= 0.0
        assert _greedy(eng)  # resumed: it generates
        with pytest.raises(ValueError, match="were not released"):
            _op(eng, "update_weights_from_window", weight_version="r2", resume_tags=["kv_cache"], **load)
        assert eng.model_info()["weight_version"] == "r1"
    finally:
        window.close()


def test_window_refusals(engine, tmp_path):
    eng, path = engine
    layout = WindowLayout.from_json(_op(eng, "weight_window_layout")["layout"])
    window = TrainerWindow(layout)
    try:
        _op(eng, "begin_weight_update")
        try:  # a session of its own: not inside another one
            with pytest.raises(ValueError, match="end_weight_update"):
                _op(eng, "update_weights_from_window", path=window.path, layout_digest=layout.digest())
        finally:
            _op(eng, "end_weight_update")
        with pytest.raises(ValueError, match="digest"):
            _op(eng, "update_weights_from_window", path=window.path, layout_digest="0" * 32)
        with pytest.raises(ValueError, match=WINDOW_PREFIX):
            _op(eng, "update_weights_from_window", path="/etc/passwd", layout_digest=layout.digest())
        short = tmp_path / f"{WINDOW_PREFIX}short"
        short.write_bytes(b"\0" * 8)
        with pytest.raises(ValueError, match="holds 8 bytes"):
            _op(eng, "update_weights_from_window", path=str(short), layout_digest=layout.digest())
        state = _trainer_state(path, seed=0)
        with pytest.raises(ValueError, match="lacks engine parameters"):
            window.check_covers([(n, tuple(t.shape)) for n, t in state.items() if "layers.1.mlp" not in n])
        with pytest.raises(ValueError, match="no parameters"):
            window.check_covers([("model.not_a_tensor", (1,))])
        name = next(iter(state))
        with pytest.raises(ValueError, match="shapes differ"):
            window.check_covers([(name, (1, 2, 3))])
    finally:
        window.close()


def test_layout_asked_while_released_is_the_allocated_one(tmp_path):
    """A layout first asked while the weights are released describes the allocated shapes (not the empty
    placeholders of the released fused blocks), so the trainer's first window after a release fits."""
    path = build_word_model(tmp_path, tie_word_embeddings=True)
    engines = []
    for release_first in (False, True):
        eng = LocalEngine(
            LocalEngineConfig(model_path=str(path), max_running_requests=2, max_total_tokens=40)
        )
        eng.start()
        engines.append(eng)
        if release_first:
            _op(eng, "release_memory_occupation")
    try:
        allocated, released = (
            WindowLayout.from_json(_op(e, "weight_window_layout")["layout"]) for e in engines
        )
        assert all(e.shape[0] > 0 for e in released.entries)
        assert released.digest() == allocated.digest()
    finally:
        for eng in engines:
            eng.stop()
