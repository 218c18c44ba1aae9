"""CP=2 equals CP=1: log-probs, entropy and parameter gradients (2-process gloo, tiny random Qwen3, fp32), through
the plain-torch all-gather and through ring-flash-attn's llama3 varlen orchestration (its two flash-attn kernels
replaced by the plain-torch stand-in of tests/flash_attn_standin.py)."""

from __future__ import annotations

import copy
import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

from tests.integration._util import run_distributed
from tests.tiny_models import tiny_qwen3

WORLD = 2
TEMPERATURE = 0.8


def _tiny_model():
    return tiny_qwen3(seed=0, vocab_size=80)


def _cases() -> dict[str, list[dict]]:
    g = torch.Generator().manual_seed(3)

    def seq(prompt: int, resp: int) -> dict:
        return {
            "tokens": torch.randint(0, 80, (prompt + resp,), generator=g).tolist(),
            "response_length": resp,
        }

    return {
        # 7 + 1 + 2 + 13 = 23 tokens: odd, needs 1 CP pad token; sequences of 1 and 2 tokens (< CP size);
        # the long one straddles the chunk boundary.
        "short_and_padded": [seq(3, 4), seq(1, 0), seq(1, 1), seq(5, 8)],
        # one sequence spanning both ranks, even length (no padding), response ending in zeros
        "single_long": [{**seq(6, 12), "tokens": seq(6, 12)["tokens"][:-3] + [0, 0, 0]}],
        # only token id 0 and a chunk boundary exactly at a sequence boundary (10 + 10)
        "zeros_boundary_aligned": [{"tokens": [0] * 10, "response_length": 6}, seq(4, 6)],
    }


def _loss(lps, ents):
    return sum((lp * (k + 1)).sum() for k, lp in enumerate(lps)) + 0.5 * sum(e.sum() for e in ents)


def _body(rank: int, world_size: int) -> None:
    """Runs in each of WORLD gloo processes (see tests/integration/_util.py)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from miles.backends.fsdp_utils.context_parallel import CPContext, shard_for_cp
    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.forward import forward_packed

    cp = CPContext(group=dist.group.WORLD, rank=rank, size=WORLD)
    base = _tiny_model()
    for name, samples in _cases().items():
        (packed,) = pack_sequences(samples, num_packs=1)
        shard = shard_for_cp(packed.tokens, packed.position_ids, packed.cu_seqlens, cp)
        assert shard.tokens.numel() - packed.num_tokens == packed.num_tokens % WORLD, name

        ref_model, cp_model = copy.deepcopy(base), copy.deepcopy(base)
        ref_lp, ref_ent = forward_packed(ref_model, packed, TEMPERATURE, cp=None, with_entropy=True)
        _loss(ref_lp, ref_ent).backward()
        lp, ent = forward_packed(cp_model, packed, TEMPERATURE, cp=cp, with_entropy=True)
        _loss(lp, ent).backward()

        for a, b, c in zip(lp, ref_lp, packed.response_lengths.tolist()):
            assert a.shape == (c,), name
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{name} log-probs")
        for a, b in zip(ent, ref_ent):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{name} entropy")
        for (pname, p), q in zip(cp_model.named_parameters(), ref_model.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            grad /= WORLD  # mean over the CP group, what FSDP2 averaging over the dp_cp mesh does
            torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-5, msg=f"{name} grad {pname}")
            # each rank alone holds only part of the gradient: the CP split is real
        if name == "short_and_padded":
            local = cp_model.lm_head.weight.grad
            assert not torch.allclose(local, ref_model.lm_head.weight.grad, atol=1e-4)
    dist.barrier()


def test_cp2_equals_cp1():
    run_distributed(_body, WORLD)


def test_cp_context_and_shard_validation():
    from miles.backends.fsdp_utils.context_parallel import CPContext, shard_for_cp

    with pytest.raises(ValueError, match="rank=2 size=2"):
        CPContext(group=None, rank=2, size=2)
    cp = CPContext(group=None, rank=1, size=3)
    tokens = torch.arange(1, 8)
    shard = shard_for_cp(
        tokens, torch.tensor([0, 1, 2, 0, 1, 2, 3]), torch.tensor([0, 3, 7], dtype=torch.int32), cp
    )
    assert shard.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0]
    assert shard.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    assert shard.cu_seqlens.tolist() == [0, 3, 7, 9]
    assert shard.local_tokens.tolist() == [4, 5, 6]
    assert shard.local_next_tokens().tolist() == [5, 6, 7]  # last local token predicts rank 2's first token
    with pytest.raises(ValueError, match="disagrees"):
        shard_for_cp(tokens, torch.arange(7), torch.tensor([0, 6], dtype=torch.int32), cp)


def _require_ring_flash_attn() -> None:
    """Skip without ring-flash-attn; under CI=true fail instead (CI installs it: scripts/install.sh)."""
    if importlib.util.find_spec("ring_flash_attn") is not None:
        return
    message = "ring-flash-attn is not installed (pip install --no-deps ring-flash-attn)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI must install it (scripts/install.sh)")
    pytest.skip(message)


def _ring_body(rank: int, world_size: int, heads_k_stride: int | None) -> None:
    from miles.backends.fsdp_utils import context_parallel
    from tests import flash_attn_standin

    flash_attn_standin.install()
    context_parallel.set_cp_kernel("ring")
    context_parallel.RING_HEADS_K_STRIDE = heads_k_stride
    _body(rank, world_size)
    # the ring kernels ran (forward and backward), the plain-torch path did not stand in for them
    calls = flash_attn_standin.CALLS
    assert calls["forward"] > 0 and calls["backward"] > 0, calls
    # loaded without the package __init__ and its HF adapter (which fails under transformers 5)
    assert not any(m == "ring_flash_attn" or m.startswith("ring_flash_attn.") for m in sys.modules)


@pytest.mark.parametrize("heads_k_stride", [None, 1], ids=["all-kv-heads", "one-kv-head-per-step"])
def test_cp2_equals_cp1_through_ring_flash_attn(heads_k_stride):
    _require_ring_flash_attn()
    run_distributed(_ring_body, WORLD, heads_k_stride)


def test_ring_kernel_import_names_the_package(monkeypatch):
    from miles.backends.fsdp_utils import context_parallel

    monkeypatch.delitem(sys.modules, "_miles_ring_flash_attn.llama3_flash_attn_varlen", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ring_flash_attn" else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match=r"ring-flash-attn: pip install 'miles\[gpu\]'"):
        context_parallel.import_ring_kernels()


def test_cp_kernel_choice(monkeypatch):
    import torch

    from miles.backends.fsdp_utils import attention, context_parallel

    with pytest.raises(ValueError, match="not one of"):
        context_parallel.set_cp_kernel("zigzag")
    q = torch.zeros(1, 2, 4, 8)
    assert context_parallel._cp_kernel == "auto" and not context_parallel._use_ring(q)  # CPU: plain torch
    try:
        context_parallel.set_cp_kernel("ring")
        assert context_parallel._use_ring(q)
    finally:
        context_parallel.set_cp_kernel("auto")
    # as on CUDA: FlashAttention-2 goes through the ring; FlashAttention-3 is refused, not run as FA2
    monkeypatch.setattr(context_parallel, "use_flash_kernel", lambda query: True)
    try:
        attention.set_varlen_backend("flash")
        assert context_parallel._use_ring(q)
        attention.set_varlen_backend("flash3")
        with pytest.raises(ValueError, match="FlashAttention-3 has no context-parallel kernel"):
            context_parallel._use_ring(q)
    finally:
        attention.set_varlen_backend("auto")
