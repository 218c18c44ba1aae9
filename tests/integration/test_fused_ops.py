"""fused_ops: the compiled RMSNorm / rotary / SwiGLU formulas against HF's eager modules (loop-free references are
HF's own classes), and a whole tiny Qwen3 forward and backward with the swapped forwards against the eager model.
torch.compile runs on CPU too (inductor's C++ backend), so the swap is checked without a GPU."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from transformers.models.qwen3 import modeling_qwen3

from miles.backends.fsdp_utils import fused_ops
from tests.tiny_models import tiny_qwen3

pytestmark = pytest.mark.slow  # inductor compiles on first use (~tens of seconds on 2 cores)


def test_references_equal_hf_modules():
    torch.manual_seed(0)
    norm = modeling_qwen3.Qwen3RMSNorm(16, eps=1e-6)
    norm.weight.data.normal_()
    x = torch.randn(3, 7, 16, dtype=torch.bfloat16)
    assert torch.equal(fused_ops.rms_norm_reference(x, norm.weight.bfloat16(), 1e-6), norm.bfloat16()(x))
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    for got, want in zip(
        fused_ops.rotary_reference(q, k, cos, sin), modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    ):
        assert torch.equal(got, want)


def test_compile_works_on_cpu():
    assert fused_ops.compile_works(torch.device("cpu"), torch.float32) is None


def test_fused_model_matches_eager_forward_and_backward(monkeypatch):
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", modeling_qwen3.apply_rotary_pos_emb)
    eager = tiny_qwen3(seed=3)
    fused = copy.deepcopy(eager)
    counts = fused_ops.fuse_elementwise_ops(fused)
    layers = eager.config.num_hidden_layers
    # per layer: input, post-attention, q and k norms; plus the final norm
    assert counts == {"rms_norm": 4 * layers + 1, "mlp": layers, "rotary": 1}
    assert fused_ops.fuse_elementwise_ops(fused) == {"rms_norm": 0, "mlp": 0, "rotary": 0}  # idempotent
    # the rotary patch routes CPU tensors to the original: check the compiled path by forcing it
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    ids = torch.randint(0, 96, (2, 11))
    outs = []
    for model in (eager, fused):
        logits = model(input_ids=ids, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (le, ge), (lf, gf) = outs
    assert torch.allclose(le, lf, atol=1e-5, rtol=1e-5)
    assert ge.keys() == gf.keys()
    for name in ge:
        assert torch.allclose(ge[name], gf[name], atol=1e-5, rtol=1e-4), name
    # the swap is really in place: the fused model's norms and MLPs run the compiled forwards
    assert fused.model.norm.forward.__func__ is fused_ops._norm_forward
    assert fused.model.layers[0].mlp.forward.__func__ is fused_ops._mlp_forward
    assert modeling_qwen3.apply_rotary_pos_emb._miles_fused
    assert "torch._dynamo" in sys.modules
