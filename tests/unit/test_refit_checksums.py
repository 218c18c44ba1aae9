"""Refit checksums: SGLang's CUDA tile hash re-derived in torch (against a plain-loop reading of its definition;
against SGLang's own triton kernel in tests/integration/test_sglang_conformance.py), and the trainer's per-TP-rank
checksums against a fake SGLang engine whose ranks hold their shards as SGLang's parallel layers cut them."""

from __future__ import annotations

import hashlib

import pytest
import torch

from miles.refit import engine_endpoints
from miles.refit.checksums import RefitChecksums, ShardSpec, vocab_blocks
from miles.utils.weight_checksum import cuda_tensor_hash, device_hash_kind, tensor_checksum

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def loop_hash(t: torch.Tensor) -> int:
    """SGLang's gpu_tensor_hash as its definition reads, one word at a time in Python ints."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 4)
    words = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]
    if not words:
        return 0
    seed1 = 0x243F6A88
    seed2 = ((0x243F6A88 * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    total = 0
    for tile_start in range(0, len(words), 8192):
        h1 = h2 = 0
        for i in range(tile_start, min(tile_start + 8192, len(words))):
            p1 = ((i * 0x27D4EB2D + seed1) & M32) ^ _rotl(i, 15)
            p2 = ((i * 0x165667B1 + seed2) & M32) ^ _rotl(i, 13)
            h1 = (h1 + _fmix32(words[i] ^ p1)) & M32
            h2 = (h2 + _fmix32(words[i] ^ p2)) & M32
        h1, h2 = _fmix32(h1 ^ (4 * len(words))), _fmix32(h2 ^ (4 * len(words)))
        total = (total + ((h1 << 32) | h2)) & M64
    total ^= total >> 30
    total = (total * 0xBF58476D1CE4E5B9) & M64
    total ^= total >> 27
    total = (total * 0x94D049BB133111EB) & M64
    return total ^ (total >> 31)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0),
        torch.tensor([7], dtype=torch.uint8),  # one byte: padded to a word
        torch.arange(5, dtype=torch.uint8),
        torch.randn(37, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),  # odd half-words
        torch.randn(
            8192 * 2 + 9, generator=torch.Generator().manual_seed(1)
        ),  # three tiles, the last partial
        torch.randint(-(2**62), 2**62, (4100,), generator=torch.Generator().manual_seed(2)),  # int64: 2 tiles
        torch.rand(33) > 0.5,
        torch.randn(6, 8)[:, ::2],  # not contiguous: hashed as its contiguous bytes
    ],
)
def test_cuda_hash_matches_the_plain_loop_definition(tensor: torch.Tensor) -> None:
    assert cuda_tensor_hash(tensor) == loop_hash(tensor)


def test_checksum_kinds() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert (
        tensor_checksum(t, "sha256")
        == hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).digest()[:8].hex()
    )
    assert tensor_checksum(t, "cuda") == f"{loop_hash(t):016x}" != tensor_checksum(t, "sha256")
    assert tensor_checksum(t, "cuda") != tensor_checksum(t.float(), "cuda")  # raw bytes: the dtype matters
    assert (device_hash_kind("cuda:1"), device_hash_kind(torch.device("cpu"))) == ("cuda", "sha256")
    with pytest.raises(ValueError, match="allowed"):
        tensor_checksum(t, "md5")


HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 8, 4, 2, 12, 70
HEAD_DIM = HIDDEN // HEADS


def _hf_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.q_proj.bias": r(HEADS * HEAD_DIM),
        p + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.bias": r(KV_HEADS * HEAD_DIM),
        p + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.bias": r(KV_HEADS * HEAD_DIM),
        p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": r(INTER, HIDDEN),
        p + "mlp.up_proj.weight": r(INTER, HIDDEN),
        p + "mlp.down_proj.weight": r(HIDDEN, INTER),
        p + "mlp.router.weight": r(3, HIDDEN),  # a layout the trainer does not know at TP > 1
        "model.norm.weight": r(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
    }


def _sglang_rank(state: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What TP rank ``rank`` of SGLang holds, written out head by head and column by column."""
    p = "model.layers.0."
    heads_here = HEADS // tp
    q_rows = [
        h * HEAD_DIM + i for h in range(rank * heads_here, (rank + 1) * heads_here) for i in range(HEAD_DIM)
    ]
    if KV_HEADS >= tp:
        kv_heads = list(range(rank * KV_HEADS // tp, (rank + 1) * KV_HEADS // tp))
    else:  # each KV head replicated over tp // KV_HEADS ranks
        kv_heads = [rank // (tp // KV_HEADS)]
    kv_rows = [h * HEAD_DIM + i for h in kv_heads for i in range(HEAD_DIM)]
    inter = INTER // tp
    mlp_rows = list(range(rank * inter, (rank + 1) * inter))
    padded = 128  # 70 rows padded to a multiple of 64, which 2 and 4 ranks split evenly
    vocab = padded // tp

    def vocab_shard(w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(vocab, HIDDEN)
        for i in range(vocab):
            row = rank * vocab + i
            if row < VOCAB:
                out[i] = w[row]
        return out

    def attn(name: str, part: str) -> torch.Tensor:
        return state[p + f"self_attn.{name}.{part}"]

    return {
        "model.embed_tokens.weight": vocab_shard(state["model.embed_tokens.weight"]),
        p + "input_layernorm.weight": state[p + "input_layernorm.weight"],
        p + "self_attn.qkv_proj.weight": torch.cat(
            [
                attn("q_proj", "weight")[q_rows],
                attn("k_proj", "weight")[kv_rows],
                attn("v_proj", "weight")[kv_rows],
            ]
        ),
        p + "self_attn.qkv_proj.bias": torch.cat(
            [attn("q_proj", "bias")[q_rows], attn("k_proj", "bias")[kv_rows], attn("v_proj", "bias")[kv_rows]]
        ),
        p + "self_attn.o_proj.weight": attn("o_proj", "weight")[:, q_rows],
        p + "mlp.gate_up_proj.weight": torch.cat(
            [state[p + "mlp.gate_proj.weight"][mlp_rows], state[p + "mlp.up_proj.weight"][mlp_rows]]
        ),
        p + "mlp.down_proj.weight": state[p + "mlp.down_proj.weight"][:, mlp_rows],
        p + "mlp.router.weight": state[p + "mlp.router.weight"][rank : rank + 1],  # sharded somehow
        "model.norm.weight": state["model.norm.weight"],
        "lm_head.weight": vocab_shard(state["lm_head.weight"]),
        "model.rotary_emb.inv_freq": torch.ones(2),  # an engine-only buffer: not comparable
    }


def _checker_answer(state: dict[str, torch.Tensor], tp: int, kind: str) -> dict:
    """SGLang's /weights_checker body: one entry per rank (in no particular order), each also serving a draft
    model (its names prefixed with its role), plus a scheduler serving only a draft model."""
    entries = []
    for rank in reversed(range(tp)):
        sums = {n: tensor_checksum(t, kind) for n, t in _sglang_rank(state, tp, rank).items()}
        sums["draft.model.norm.weight"] = "0" * 16
        infos = [{"role": "target", "tp_rank": rank, "tp_size": tp}, {"role": "draft", "tp_rank": rank}]
        entries.append({"checksums": sums, "per_gpu_checksum": "x", "parallelism_info": infos})
    draft = [{"role": "draft", "tp_rank": 0}]
    entries.append({"checksums": {"x": "0"}, "per_gpu_checksum": "y", "parallelism_info": draft})
    return {"success": True, "message": "Success.", "ranks": entries}


def _trainer_checks(state: dict[str, torch.Tensor], tp: int, kind: str) -> RefitChecksums:
    checks = RefitChecksums(ShardSpec(tp, kind, KV_HEADS))
    items = list(state.items())
    for i in range(0, len(items), 3):  # buckets split q/k/v and gate/up apart
        checks.add_bucket(items[i : i + 3])
    return checks


@pytest.mark.parametrize("kind", ["sha256", "cuda"])
@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_checksums_match_sglangs_shards_and_name_a_corrupted_one(
    monkeypatch, tp: int, kind: str
) -> None:
    state = _hf_state()
    answers: list[dict] = []
    monkeypatch.setattr(engine_endpoints, "post_engine", lambda *a, **k: answers.pop(0))
    checks = _trainer_checks(state, tp, kind)
    answers.append(_checker_answer(state, tp, kind))
    engine_endpoints.check_engine("http://e0", "7", {}, 5.0, checks)
    # every name both sides know is compared on every rank (the router and inv_freq are not)
    assert all(len(checks.expected[r]) == 9 for r in range(tp))
    assert "model.layers.0.mlp.router.weight" not in checks.expected[0]
    assert checks.reported and checks.engine_seconds >= 0 and checks.seconds > 0

    corrupted = {
        **state,
        "model.layers.0.mlp.down_proj.weight": state["model.layers.0.mlp.down_proj.weight"].clone(),
    }
    corrupted["model.layers.0.mlp.down_proj.weight"][0, -1] += 1.0  # a column of the last rank's shard
    answers.append(_checker_answer(corrupted, tp, kind))
    with pytest.raises(RuntimeError) as err:
        engine_endpoints.check_engine("http://e0", "7", {}, 5.0, checks)
    msg = str(err.value)
    assert "engine http://e0" in msg and "weight version 7" in msg and f"1 of {9 * tp} tensors" in msg
    assert f"model.layers.0.mlp.down_proj.weight (TP rank {tp - 1})" in msg

    # the other hash kind (an engine on the other device) differs everywhere
    other = "sha256" if kind == "cuda" else "cuda"
    answers.append(_checker_answer(state, tp, other))
    with pytest.raises(RuntimeError, match=f"{9 * tp} of {9 * tp} tensors differ"):
        engine_endpoints.check_engine("http://e0", "7", {}, 5.0, checks)


def test_wrong_tp_size_and_unknown_kv_heads(monkeypatch) -> None:
    state = _hf_state()
    checks = _trainer_checks(state, 2, "sha256")
    monkeypatch.setattr(engine_endpoints, "post_engine", lambda *a, **k: _checker_answer(state, 4, "sha256"))
    with pytest.raises(RuntimeError, match="reports 4 TP ranks, the trainer expects 2"):
        engine_endpoints.check_engine("http://e0", "3", {}, 5.0, checks)
    unknown = RefitChecksums(ShardSpec(2, "sha256", kv_heads=None))
    unknown.add_bucket(state.items())
    assert "model.layers.0.self_attn.qkv_proj.weight" not in unknown.expected[0]  # k/v layout unknown
    assert "model.layers.0.mlp.gate_up_proj.weight" in unknown.expected[0]


def test_tp1_hashes_whole_tensors_fused_and_padded_embeddings_and_only_wanted_names() -> None:
    state = _hf_state()
    checks = _trainer_checks(state, 1, "sha256")
    sums = checks.expected[0]
    # the embedded engine's HF names, and SGLang's fused names and padded vocab
    assert sums["model.layers.0.mlp.router.weight"] == {
        tensor_checksum(state["model.layers.0.mlp.router.weight"])
    }
    for name, t in _sglang_rank(state, 1, 0).items():
        if name != "model.rotary_emb.inv_freq" and "router" not in name:
            assert tensor_checksum(t) in sums[name], name
    assert len(sums["model.embed_tokens.weight"]) == 2  # padded (SGLang) or not (embedded engine)
    wanted = RefitChecksums(ShardSpec(1), wanted={"model.norm.weight"})
    wanted.add_bucket(state.items())
    assert list(wanted.expected[0]) == ["model.norm.weight"]


def test_vocab_padding_grows_to_64_times_tp_when_64_does_not_split() -> None:
    w = torch.arange(70 * 2, dtype=torch.float32).reshape(70, 2)
    blocks = vocab_blocks(w, 3)  # 128 rows do not split in 3: padded to 192
    assert [b.shape[0] for b in blocks] == [64, 64, 64]
    assert torch.equal(blocks[1][:6], w[64:70]) and not blocks[1][6:].any() and not blocks[2].any()
