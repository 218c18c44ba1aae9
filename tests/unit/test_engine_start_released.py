"""An embedded engine started without weights (`--start-released`, how a training rank hosts its colocated
engine: the start-up refit brings the rank's own weights): the model is built from its config alone (no weight
read, buffers and tied parameters as `from_pretrained` makes them), generation is refused until a resume and a
refit, the first resume allocates nothing, and the refitted engine generates exactly what a loaded one does."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engines.local.__main__ import engine_config, parse_args
from miles.engines.local.engine import LocalEngine
from miles.engines.local.vl_runner import load_model
from miles.engines.local.weights import EngineNotReady
from miles.refit.window import TrainerWindow
from miles.refit.window_layout import WindowLayout
from miles.tools.tiny_model import build_word_model

TAGS = ["weights", "kv_cache"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_word_model(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=True))


def _engine(path: str, *flags: str) -> LocalEngine:
    argv = [
        f"--model-path={path}",
        "--max-running-requests=2",
        "--max-total-tokens=40",
        "--no-cpu-decode-kernel",
    ]
    argv += flags
    eng = LocalEngine(engine_config(parse_args(argv)))
    eng.start()
    return eng


def _op(eng: LocalEngine, name: str, **kw):
    return eng.run(name, **kw).result(30)


def _greedy(eng: LocalEngine) -> list[int]:
    request = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    }
    _, futs, _ = eng.submit_generate(request)
    return futs[0].result(30)["output_ids"]


def _sent(path: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as a trainer sends them (tied ones once)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    out, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t.detach().clone()))
    return out


@pytest.mark.parametrize("tie", [True, False])
def test_unloaded_model_reads_no_weights_and_is_built_as_from_pretrained(tmp_path, tie):
    path = build_word_model(tmp_path / "m", tie_word_embeddings=tie)
    loaded, _ = load_model(str(path), torch.float32)
    no_weights = tmp_path / "config-only"
    shutil.copytree(path, no_weights)
    (no_weights / "model.safetensors").unlink()  # nothing to read: from_pretrained would fail here
    model, vl = load_model(str(no_weights), torch.float32, weights=False)
    assert vl is None
    shapes = [(n, p.shape, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)]
    assert shapes == [(n, p.shape, p.dtype) for n, p in loaded.named_parameters(remove_duplicate=False)]
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    buffers = dict(loaded.named_buffers())
    assert buffers and dict(model.named_buffers()).keys() == buffers.keys()
    for name, buf in model.named_buffers():
        assert buf.dtype == buffers[name].dtype and torch.equal(buf, buffers[name]), name


def test_engine_started_released_serves_exactly_the_refit_weights(model_dir):
    loaded = _engine(model_dir)
    try:
        expected = _greedy(loaded)
        full = loaded.weights.allocated_bytes()
    finally:
        loaded.stop()
    eng = _engine(model_dir, "--start-released")
    try:
        assert eng.released_tags == {"weights"} and eng.weights.allocated_bytes() == 0
        with pytest.raises(EngineNotReady, match="released"):
            _greedy(eng)
        _op(eng, "release_memory_occupation", tags=TAGS)  # the driver's start-up release
        _op(eng, "resume_memory_occupation", tags=TAGS)
        assert eng.weights.allocated_bytes() == 0  # nothing to give back: the refit allocates what it writes
        with pytest.raises(EngineNotReady, match="not loaded"):
            _greedy(eng)
        _op(eng, "begin_weight_update")
        eng.weights.load(_sent(model_dir))
        _op(eng, "end_weight_update")
        assert _greedy(eng) == expected  # bitwise the same tokens as the engine that read the checkpoint
        assert eng.weights.allocated_bytes() == full
        _op(eng, "release_memory_occupation", tags=["weights"])
        _op(eng, "resume_memory_occupation", tags=["weights"])
        assert eng.weights.allocated_bytes() == full  # loaded once: a resume allocates again, as before
    finally:
        eng.stop()


def test_engine_started_released_takes_a_window_refit(model_dir):
    eng = _engine(model_dir, "--start-released")
    try:
        layout = WindowLayout.from_json(_op(eng, "weight_window_layout")["layout"])
        window = TrainerWindow(layout)
        try:
            sent = _sent(model_dir)
            window.check_covers([(n, tuple(t.shape)) for n, t in sent])
            for name, t in sent:
                window.views[name].copy_(t)
            answer = _op(eng, "update_weights_from_window", path=window.path, layout_digest=layout.digest(),
                         weight_version="v1", resume_tags=["weights"], checksums=True)  # fmt: skip
            assert answer["weight_version"] == "v1" and not eng.released_tags
            for name, t in sent:
                assert torch.equal(eng.weights.get(name), t), name
            assert _greedy(eng)
        finally:
            window.close()
    finally:
        eng.stop()
