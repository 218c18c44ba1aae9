"""Refit names of MoE experts (issue 28): stacked expert tensors are sent per expert under SGLang's names, exactly,
in the orientation transformers' experts compute with; SGLang's loaders take every name; the embedded engine
assembles the pieces into the same weights, log-probs and checksums."""

from __future__ import annotations

import ast

import pytest
import torch

from miles.refit.buckets import RefitJob, stream_buckets
from miles.refit.checksums import RefitChecksums, ShardSpec
from miles.refit.engine_endpoints import compare_checksums
from miles.refit.moe_names import expert_piece, split_bucket, split_stacked


def _sent(model: torch.nn.Module, bucket_bytes: int = 1 << 13) -> list[tuple[str, torch.Tensor]]:
    """Everything a refit of ``model`` sends, bucket by bucket."""
    out: list[tuple[str, torch.Tensor]] = []
    stream_buckets(RefitJob(model, bucket_bytes, "v"), None, lambda b, i, last: out.extend(b))
    return out


def test_split_is_exact_and_matches_the_experts_forward() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=6, num_experts=3, hidden_act="silu")
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    pieces = dict(
        split_bucket(
            [("m.layers.0.mlp.experts.gate_up_proj", gu), ("m.layers.0.mlp.experts.down_proj", down)]
        )
    )
    assert len(pieces) == 9 and pieces["m.layers.0.mlp.experts.2.up_proj.weight"].shape == (6, 16)
    assert pieces["m.layers.0.mlp.experts.1.down_proj.weight"].shape == (16, 6)
    for e in range(3):
        gate, up = (pieces[f"m.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(torch.cat([gate, up]), gu[e])
        assert torch.equal(pieces[f"m.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
    x = torch.randn(5, 16)
    for e in range(3):  # every token to expert e with weight 1: transformers' output is expert e's MLP
        ref = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
        lin = {p: torch.nn.Linear(16, 6, bias=False) for p in ("gate", "up")}
        lin["down"] = torch.nn.Linear(6, 16, bias=False)
        with torch.no_grad():
            for p, m in lin.items():
                m.weight.copy_(pieces[f"m.layers.0.mlp.experts.{e}.{p}_proj.weight"])
            mine = lin["down"](torch.nn.functional.silu(lin["gate"](x)) * lin["up"](x))
        torch.testing.assert_close(mine, ref.detach(), atol=1e-5, rtol=1e-5)
    w = gu[0]
    [(dense, t)] = split_stacked("m.mlp.gate_up_proj.weight", w)  # a dense MLP's weight: as it is
    assert dense == "m.mlp.gate_up_proj.weight" and t is w
    assert expert_piece("a.experts.2.up_proj.weight") == ("a.experts.gate_up_proj", 2, 1, 2)
    assert expert_piece("a.experts.2.down_proj.weight") == ("a.experts.down_proj", 2, 0, 1)
    assert expert_piece("a.mlp.up_proj.weight") is None


def _tiny(kind: str, tmp_path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if kind == "qwen3_moe":
        from miles.tools.tiny_moe import build_tiny_moe

        path = build_tiny_moe(tmp_path / kind, hidden_size=32, initializer_range=0.2)
    else:
        from miles.tools.tiny_next import build_tiny_next

        path = build_tiny_next(tmp_path / kind)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _sglang_loader_names(module: str) -> tuple[list[str], tuple[str, str, str]]:
    """Read SGLang's `srt/models/<module>.py` statically: the shard names of `stacked_params_mapping` in its
    `load_weights` and the (gate, down, up) checkpoint names it gives `make_expert_params_mapping`."""
    import glob
    import os

    venv = os.environ.get("MILES_SGLANG_VENV", "/work/venvs/sglang")
    found = glob.glob(
        os.path.join(venv, "lib", "python3*", "site-packages", "sglang", "srt", "models", f"{module}.py")
    )
    if not found:
        pytest.skip("SGLang is not installed (set MILES_SGLANG_VENV)")
    with open(found[0]) as f:
        tree = ast.parse(f.read())
    shards: list[str] = []
    ckpt: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "stacked_params_mapping" for t in node.targets
        ):
            shards = [e.elts[1].value for e in node.value.elts]  # type: ignore[attr-defined]
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "make_expert_params_mapping":
            ckpt = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}  # type: ignore[misc]
    names = tuple(ckpt.get(f"ckpt_{p}_proj_name", "") for p in ("gate", "down", "up"))
    return shards, names  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next"])
def test_every_expert_name_sent_is_one_sglang_loads(tmp_path, kind: str) -> None:
    """SGLang 0.5.23's loader (as read from its source) maps a name containing `experts.<e>.<ckpt name>.` onto its
    fused expert parameters, skips experts in the stacked mapping, and silently drops unknown names; so every
    expert tensor the refit sends must match one expert mapping entry, and no stacked name may be sent."""
    shards, (gate, down, up) = _sglang_loader_names(kind)
    assert (gate, down, up) == ("gate_proj", "down_proj", "up_proj") and "up_proj" in shards
    model = _tiny(kind, tmp_path)
    experts = model.config.num_experts
    mapping = [f"experts.{e}.{w}." for e in range(experts) for w in (gate, down, up)]
    sent = _sent(model)
    expert_names = [n for n, _ in sent if ".experts." in n]
    assert len(expert_names) == 3 * experts * model.config.num_hidden_layers
    for name in expert_names:
        assert sum(m in name for m in mapping) == 1, name
    assert not [n for n, _ in sent if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    total = sum(t.numel() for _, t in sent)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # tied tensors are sent once
    assert total == sum(t.numel() for t in unique.values())  # nothing lost, nothing doubled


def test_embedded_engine_loads_per_expert_names_as_the_stacked_ones(tmp_path) -> None:
    from miles.engines.local.engine import LocalEngine, LocalEngineConfig
    from miles.tools.tiny_moe import build_tiny_moe

    path = str(build_tiny_moe(tmp_path / "m", hidden_size=32, initializer_range=0.2))
    source = _tiny("qwen3_moe", tmp_path / "src")  # another seed's weights would do; perturb to be sure
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    eng = LocalEngine(LocalEngineConfig(model_path=path, max_running_requests=2, cpu_decode_kernel=False))
    eng.start()
    try:
        store = eng.weights
        store.release()
        store.resume()
        checks = RefitChecksums(ShardSpec())
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        stream_buckets(RefitJob(source, 1 << 13, "v1"), checks, lambda b, i, last: buckets.append(list(b)))
        for b in buckets[:-1]:
            store.load(b)
        assert store.pending  # the last bucket is still missing
        store.load(buckets[-1])
        store.check_ready()
        for name, p in source.state_dict().items():
            assert torch.equal(store.get(name), p), name
        reply = eng._op_weights_checker()
        got = reply["ranks"][0]["checksums"]
        assert (
            "model.layers.0.mlp.experts.3.up_proj.weight" in got
            and "model.layers.0.mlp.experts.gate_up_proj" not in got
        )
        assert compare_checksums("local", checks.expected, [got], "v1") == len(got)
        # a partial expert refit leaves the stacked tensor pending; the stacked name still loads whole
        store.release()
        store.resume()
        stacked = [(n, t) for n, t in source.state_dict().items()]
        store.load([x for x in split_bucket(stacked) if not x[0].endswith("experts.1.gate_proj.weight")])
        assert store.pending == {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)}
        store.load(stacked)
        store.check_ready()
        ids = torch.tensor([[3, 4, 5, 6, 7]])
        with torch.no_grad():
            ref = source(input_ids=ids).logits
            mine = eng.model(input_ids=ids).logits
        assert torch.equal(mine, ref)
        with pytest.raises(ValueError, match="no such expert piece"):
            store.validate("model.layers.0.mlp.experts.9.gate_proj.weight", torch.zeros(8, 32))
    finally:
        eng.stop()
