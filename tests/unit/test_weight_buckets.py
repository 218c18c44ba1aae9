"""Bucket planning and gathering on an unsharded tiny Qwen3 (the sharded path is in tests/integration)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miles.refit.broadcast import DistributedWeightUpdater
from miles.refit.buckets import hf_name, iter_weight_buckets, plan_weight_buckets
from miles.refit.session import RefitSetup
from tests.tiny_models import tiny_qwen3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tied-embedding tiny Qwen3 and the tensors its HF checkpoint holds."""
    model = tiny_qwen3(seed=0, vocab_size=80, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return model, load_file(path / "model.safetensors")


def _nbytes(bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 10_000, 1 << 30])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_buckets_cover_the_hf_state_dict(tiny, bucket_bytes: int, dtype) -> None:
    model, hf = tiny
    buckets = list(iter_weight_buckets(model, bucket_bytes, dtype))
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(hf) and len(names) == len(set(names))  # every HF tensor exactly once
    assert "lm_head.weight" not in names  # tied to embed_tokens: sent once, as the checkpoint holds it
    for bucket in buckets:
        if len(bucket) > 1:  # only a lone tensor may exceed the limit
            assert _nbytes(bucket) <= bucket_bytes
        for name, t in bucket:
            want = hf[name] if dtype is None else hf[name].to(dtype)
            assert t.dtype == want.dtype and torch.equal(t, want), name
    assert [[n for n, _ in b] for b in buckets] == plan_weight_buckets(model, bucket_bytes, dtype)


def test_bucket_packing_is_greedy_and_tight(tiny) -> None:
    model, hf = tiny
    sizes = {n: t.numel() * 4 for n, t in hf.items()}
    limit = 3 * sizes["model.layers.0.mlp.gate_proj.weight"]
    plan = plan_weight_buckets(model, limit)
    for this, nxt in zip(plan, plan[1:]):
        # greedy: the next bucket's first tensor would not have fitted into this one
        assert sum(sizes[n] for n in this) + sizes[nxt[0]] > limit
    assert [n for b in plan for n in b] == [n for n in model.state_dict() if n != "lm_head.weight"]
    assert all(len(b) == 1 for b in plan_weight_buckets(model, 1))  # everything oversized -> one per bucket


def test_names_and_errors() -> None:
    assert (
        hf_name("model._checkpoint_wrapped_module.layers.0._orig_mod.mlp.weight")
        == "model.layers.0.mlp.weight"
    )
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_weight_buckets(torch.nn.Linear(2, 2), 0)
    with pytest.raises(ValueError, match="engine_urls is empty"):
        DistributedWeightUpdater(RefitSetup([], 1, 0, 1), "127.0.0.1", 1234)
    with pytest.raises(ValueError, match="ranks_per_engine=0"):
        RefitSetup(["http://x"], 0, 0, 1)
    with pytest.raises(ValueError, match="timeout_s=0"):
        RefitSetup(["http://x"], 1, 0, 1, timeout_s=0)
