"""recompute.recompute_mlp_activations: the MLP's silu output and product are recomputed in the backward (not
kept), and the forward and every gradient stay bit for bit those of the eager model."""

from __future__ import annotations

import copy

import torch

from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed
from miles.backends.fsdp_utils.recompute import recompute_mlp_activations
from tests.tiny_models import tiny_qwen3


def _count_calls(module: torch.nn.Module, counts: dict[str, int], key: str) -> None:
    module.register_forward_hook(lambda m, a, o: counts.__setitem__(key, counts.get(key, 0) + 1))


def _packed_step(model: torch.nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    samples = [
        {"tokens": torch.randint(3, 96, (n,), generator=gen).tolist(), "response_length": r}
        for n, r in ((13, 6), (9, 4), (17, 9))
    ]
    pack = pack_sequences(samples, num_packs=1)[0]
    log_probs, entropy = forward_packed(model, pack, 0.8, with_entropy=True)
    assert entropy is not None
    loss = sum(lp.sum() for lp in log_probs) + 0.1 * sum(e.mean() for e in entropy)
    loss.backward()
    return [lp.detach() for lp in log_probs], {n: p.grad for n, p in model.named_parameters()}


def test_forward_and_gradients_are_bitwise_the_eager_ones() -> None:
    eager = tiny_qwen3(seed=3)
    eager.train()
    recomputed = copy.deepcopy(eager)
    layers = eager.config.num_hidden_layers
    assert recompute_mlp_activations(recomputed) == layers
    assert recompute_mlp_activations(recomputed) == 0  # idempotent
    (lp_e, grads_e), (lp_r, grads_r) = _packed_step(eager), _packed_step(recomputed)
    assert all(torch.equal(a, b) for a, b in zip(lp_e, lp_r, strict=True))
    assert grads_e.keys() == grads_r.keys()
    for name, grad in grads_e.items():
        assert torch.equal(grad, grads_r[name]), name


def test_backward_recomputes_silu_but_not_down_proj() -> None:
    model = tiny_qwen3(seed=1)
    model.train()
    recompute_mlp_activations(model)
    mlp = model.model.layers[0].mlp
    counts: dict[str, int] = {}
    _count_calls(mlp.act_fn, counts, "silu")
    _count_calls(mlp.down_proj, counts, "down")
    ids = torch.randint(0, 96, (1, 12))
    out = model(input_ids=ids, use_cache=False).logits
    assert counts == {"silu": 1, "down": 1}
    out.float().logsumexp(-1).sum().backward()
    # the backward ran the silu again (its output was not kept); early stop ended before down_proj's matmul
    assert counts == {"silu": 2, "down": 1}


def test_without_gradients_runs_the_eager_module() -> None:
    model = tiny_qwen3(seed=2)
    recompute_mlp_activations(model)
    counts: dict[str, int] = {}
    _count_calls(model.model.layers[0].mlp.act_fn, counts, "silu")
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        model.train()
        a = model(input_ids=ids, use_cache=False).logits
    model.eval()  # eval mode with gradients: eager too (nothing to train, so nothing to save memory for)
    b = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(a, b) and a.grad_fn is None
    assert counts == {"silu": 2}
    b.sum().backward()
    assert counts == {"silu": 2}  # its backward reads the kept silu output
