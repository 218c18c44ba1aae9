"""CP=2 equals CP=1: log-probs, entropy and parameter gradients (2-process gloo, tiny random Qwen3, fp32)."""

from __future__ import annotations

import copy
import os

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


def _bottom_right_causal(q, k, v, cu_q, cu_k, scale):
    """What flash_attn_varlen_func(causal=True) computes: per sequence, query i sees keys <= (lk - lq) + i."""
    outs = []
    for qa, qb, ka, kb in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        lq, lk = qb - qa, kb - ka
        allowed = torch.arange(lk)[None, :] <= (lk - lq) + torch.arange(lq)[:, None]
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[qa:qb], k[ka:kb], v[ka:kb]))
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)  # [C, H, D]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_flash_key_layout_matches_masked_sdpa(rank):
    # The CUDA path feeds cp_key_layout to flash-attn; check the layout on CPU against the SDPA path.
    from miles.backends.fsdp_utils.context_parallel import (
        CPContext,
        _attend_sdpa,
        cp_key_layout,
        shard_for_cp,
    )

    torch.manual_seed(rank)
    lengths = [5, 1, 9, 2, 6]  # 23 tokens -> padded to 24, chunks of 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    shard = shard_for_cp(torch.arange(23), pos, cu, CPContext(group=None, rank=rank, size=3))
    q = torch.randn(1, 4, shard.chunk, 8)
    kv = torch.randn(1, 4, 24, 8)  # 2 KV heads for K, 2 for V, over the padded row
    want = _attend_sdpa(q, kv, shard, 0.35, 0.0)[0].transpose(0, 1)  # [C, H, D]
    key_index, cu_q, cu_k, max_q, max_k = cp_key_layout(shard)
    assert int(cu_q[-1]) == shard.chunk and max_q <= shard.chunk and max_k >= max_q
    k = kv[0, :2].index_select(1, key_index).transpose(0, 1)
    v = kv[0, 2:].index_select(1, key_index).transpose(0, 1)
    got = _bottom_right_causal(q[0].transpose(0, 1), k, v, cu_q, cu_k, 0.35)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
