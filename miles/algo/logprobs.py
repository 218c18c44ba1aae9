"""Log-probabilities and entropy of next tokens, the one definition shared by trainer and tests.

Both follow the rollout engine's convention: logits are divided by the sampling temperature and a float32
log-softmax is taken, so `log_probs` here are comparable with the engine's `output_token_logprobs`.
"""

from __future__ import annotations

import torch


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def compute_log_probs(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target_ids[t] | .) under softmax(logits[t] / temperature), in float32.

    logits: [T, V]; target_ids: [T] (long). Returns [T]. Differentiable.
    """
    scaled = _scaled(logits, temperature)
    return scaled.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def compute_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits[t] / temperature) per position, in float32. logits: [T, V] -> [T]."""
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# Rows of fp32 work per chunk of `log_probs_and_entropy`: about this many bytes of [rows, V] float32 at a time.
_CHUNK_BYTES = 256 * 1024 * 1024


def _chunk_rows(num_rows: int, vocab: int, chunk_rows: int | None) -> int:
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    return max(1, min(max(num_rows, 1), _CHUNK_BYTES // (4 * max(vocab, 1))))


class _LogProbEntropy(torch.autograd.Function):
    """Log-probs of targets and (optionally) entropy, computed over row chunks in float32.

    Saves only the input logits (no copy: they are alive anyway for the caller's graph), the targets and one
    float32 log-sum-exp per row; the backward recomputes each chunk's softmax. Peak extra memory is one chunk of
    [rows, V] float32 instead of several [T, V] float32 tensors held for the backward pass.
    """

    @staticmethod
    def forward(ctx, logits, target_ids, temperature, with_entropy, rows):
        n = logits.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for s in range(0, n, rows):
            z = _scaled(logits[s : s + rows], temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[s : s + rows] = chunk_lse
            lp[s : s + rows] = z.gather(-1, target_ids[s : s + rows].unsqueeze(-1)).squeeze(-1) - chunk_lse
            if ent is not None:
                logp = torch.log_softmax(z, dim=-1)  # as compute_entropy, for the same numbers
                ent[s : s + rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, target_ids, lse, ent if ent is not None else lse.new_empty(0))
        ctx.temperature, ctx.with_entropy, ctx.rows = temperature, with_entropy, rows
        if ent is None:
            return lp
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent=None):
        logits, target_ids, lse, ent = ctx.saved_tensors
        grad = torch.empty_like(logits)
        rows = ctx.rows
        for s in range(0, logits.shape[0], rows):
            z = _scaled(logits[s : s + rows], ctx.temperature)
            logp = z - lse[s : s + rows].unsqueeze(-1)
            p = logp.exp()
            # d lp / dz = onehot(target) - p
            g = -p * grad_lp[s : s + rows].unsqueeze(-1)
            g.scatter_add_(-1, target_ids[s : s + rows].unsqueeze(-1), grad_lp[s : s + rows].unsqueeze(-1))
            if ctx.with_entropy and grad_ent is not None:
                # d H / dz = -p * (log p + H)
                g -= p * (logp + ent[s : s + rows].unsqueeze(-1)) * grad_ent[s : s + rows].unsqueeze(-1)
            if ctx.temperature != 1.0:
                g /= ctx.temperature
            grad[s : s + rows] = g.to(grad.dtype)
        return grad, None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`compute_log_probs` and (with `with_entropy`) `compute_entropy` of the same logits in one pass, without
    holding [T, V] float32 copies: rows are processed in chunks (`chunk_rows`, default about 256 MiB of float32
    per chunk) in the forward and recomputed chunk by chunk in the backward.

    logits: [T, V] (any float dtype); target_ids: [T]. Returns (log_probs [T], entropy [T] or None), float32,
    differentiable with respect to `logits`. The values are the same numbers as `compute_log_probs` and
    `compute_entropy` give (row-wise reductions do not depend on the chunking); gradients agree to rounding.
    """
    if logits.dim() != 2 or target_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [T, V] and target_ids [T], got {tuple(logits.shape)}, {tuple(target_ids.shape)}"
        )
    _scaled(logits[:0], temperature)  # validates the temperature
    rows = _chunk_rows(logits.shape[0], logits.shape[-1], chunk_rows)
    out = _LogProbEntropy.apply(logits, target_ids.long(), float(temperature), with_entropy, rows)
    if with_entropy:
        return out[0], out[1]
    return out, None
