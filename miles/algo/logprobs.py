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


def compute_log_probs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target_ids[t] | .) under softmax(logits[t] / temperature), in float32.

    logits: [T, V]; target_ids: [T] (long). Returns [T]. Differentiable.
    """
    scaled = _scaled(logits, temperature)
    return scaled.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def compute_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits[t] / temperature) per position, in float32. logits: [T, V] -> [T]."""
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)
