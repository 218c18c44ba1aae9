"""`log_probs_and_entropy` (row-chunked, recomputing backward) against the plain `compute_log_probs` /
`compute_entropy` reference: the same values, the same gradients up to rounding, and no [T, V] float32 tensor held
for the backward pass."""

from __future__ import annotations

import pytest
import torch

from miles.algo.logprobs import compute_entropy, compute_log_probs, log_probs_and_entropy

CASES = [  # rows, vocab, temperature, chunk rows (None: by bytes)
    (7, 13, 1.0, 3),
    (10, 50, 0.7, 4),
    (1, 5, 1.3, None),
    (33, 151, 0.8, None),
    (64, 97, 0.6, 64),
    (9, 31, 1.0, 100),
]


def _reference(x: torch.Tensor, t: torch.Tensor, temp: float) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_log_probs(x, t, temp), compute_entropy(x, temp)


@pytest.mark.parametrize("rows,vocab,temp,chunk", CASES)
def test_values_are_the_reference_numbers(rows, vocab, temp, chunk):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=g) * 4
    t = torch.randint(0, vocab, (rows,), generator=g)
    lp, ent = log_probs_and_entropy(x, t, temp, with_entropy=True, chunk_rows=chunk)
    ref_lp, ref_ent = _reference(x, t, temp)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    lp_only, none = log_probs_and_entropy(x, t, temp, chunk_rows=chunk)
    assert none is None and torch.equal(lp_only, ref_lp)


@pytest.mark.parametrize("rows,vocab,temp,chunk", CASES)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_match_autograd(rows, vocab, temp, chunk, with_entropy):
    g = torch.Generator().manual_seed(rows + vocab)
    base = torch.randn(rows, vocab, generator=g, dtype=torch.float64).float() * 4
    t = torch.randint(0, vocab, (rows,), generator=g)
    w_lp, w_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)

    x = base.clone().requires_grad_(True)
    lp, ent = log_probs_and_entropy(x, t, temp, with_entropy=with_entropy, chunk_rows=chunk)
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
    loss.backward()

    y = base.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(y, t, temp)
    ref = (ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0.0)
    ref.backward()
    torch.testing.assert_close(x.grad, y.grad, atol=2e-6, rtol=1e-5)


def test_entropy_gradient_only_and_bf16_logits():
    """Only the entropy feeds the loss (the log-prob output gets no gradient); bf16 logits get a bf16 gradient."""
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(12, 40, generator=g) * 3).to(torch.bfloat16)
    t = torch.randint(0, 40, (12,), generator=g)
    x = base.clone().requires_grad_(True)
    _, ent = log_probs_and_entropy(x, t, 0.9, with_entropy=True, chunk_rows=5)
    ent.sum().backward()
    y = base.clone().requires_grad_(True)
    compute_entropy(y, 0.9).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), y.grad.float(), atol=1e-2, rtol=1e-2)


def test_empty_rows_and_extreme_logits():
    lp, ent = log_probs_and_entropy(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    x = torch.tensor([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    lp, ent = log_probs_and_entropy(x, torch.tensor([1, 2]), with_entropy=True)
    ref_lp, ref_ent = _reference(x.detach(), torch.tensor([1, 2]), 1.0)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    (lp.clamp(min=-100).sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_saves_no_float32_copy_of_the_logits():
    """What the backward pass keeps: the logits themselves (no copy), the targets and a few [T] vectors; the plain
    reference keeps [T, V] float32 tensors."""
    rows, vocab = 64, 512
    x = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))

    def saved_bytes(fn) -> int:
        sizes: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.data_ptr() != x.data_ptr():
                sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
        return sum(sizes)

    ours = saved_bytes(lambda: log_probs_and_entropy(x, t, 0.8, with_entropy=True, chunk_rows=8))
    plain = saved_bytes(lambda: (compute_log_probs(x, t, 0.8), compute_entropy(x, 0.8)))
    assert ours <= rows * 8 * 4, ours  # targets (int64) + lse + entropy
    assert plain >= rows * vocab * 4, plain


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        log_probs_and_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_rows=0)
