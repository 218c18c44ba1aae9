"""Sampling parameters (SGLang's `sampling_params` field names) and the sampler.

`sample_batch` samples one token per row of a batch of logits by inverse-CDF sampling: the row's request draws one
uniform number from its own RNG (seeded from the server seed and the request id), and the token is the first
whose cumulative probability (after temperature, top-k and top-p) exceeds it. A request's tokens therefore depend
on (server seed, rid) and its logits only, never on the other requests of the batch; the one Python call per row
is `random.Random.random()`, everything else is batched. `sample_token` is the one-row reference.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import torch

from miles.algo.logprobs import compute_log_probs
from miles.utils.types import JSON

# Accepted only at their neutral value: the embedded engine does not implement them.
_NEUTRAL_ONLY = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "spaces_between_special_tokens": True,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
}


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters; field names and defaults follow SGLang."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = -1  # -1 = whole vocabulary
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded output text
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string / stop token in `text`
    ignore_eos: bool = False
    sampling_seed: int | None = (
        None  # seeds this request's sampler (same answer on any engine); None: from rid
    )

    @classmethod
    def from_dict(cls, given: JSON) -> SamplingParams:
        """Validate a JSON `sampling_params` object; ValueError names each bad key and what is allowed."""
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"sampling_params must be an object, got {given!r}")
        d = dict(given or {})
        errors: list[str] = []
        for key, neutral in _NEUTRAL_ONLY.items():
            if key in d:
                value = d.pop(key)
                if value is not None and value != neutral:
                    errors.append(
                        f"{key}={value!r} is not supported by the embedded engine (only {neutral!r})"
                    )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            errors.append(f"unknown sampling params {unknown}; allowed: {sorted(known | set(_NEUTRAL_ONLY))}")
        # the fields as given, checked by _violations once the record holds them
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in known and v is not None}
        stop = kw.get("stop", ())
        kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        kw["stop_token_ids"] = tuple(int(t) for t in kw.get("stop_token_ids", ()))
        try:
            params = cls(**kw)
        except TypeError as e:
            raise ValueError(f"bad sampling_params {d!r}: {e}") from e
        errors += params._violations()
        if errors:
            raise ValueError("invalid sampling_params: " + "; ".join(errors))
        return params

    def _violations(self) -> list[str]:
        errs = []
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            errs.append(f"temperature={self.temperature!r} must be >= 0")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            errs.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            errs.append(f"top_k={self.top_k!r} must be -1 (off) or >= 1")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            errs.append(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 0")
        if self.sampling_seed is not None and (
            not isinstance(self.sampling_seed, int)
            or isinstance(self.sampling_seed, bool)
            or self.sampling_seed < 0
        ):
            errs.append(f"sampling_seed={self.sampling_seed!r} must be an int >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            errs.append(f"stop={list(self.stop)!r} must be non-empty strings")
        return errs

    @property
    def logprob_temperature(self) -> float:
        """Temperature under which log-probs are reported (1 for greedy)."""
        return 1.0 if self.temperature == 0 else float(self.temperature)


def request_rng(random_seed: int, rid: str, sampling_seed: int | None = None) -> random.Random:
    """The RNG of one request: seeded from its `sampling_seed` when it has one (the same answer on every
    engine), else from (server seed, request id); either way its samples are reproducible."""
    if sampling_seed is not None:
        return random.Random(int(sampling_seed))
    digest = hashlib.sha256(f"{random_seed}:{rid}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _keep_mask(sorted_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of the descending-sorted probabilities [R, V] survive top-k [R] and top-p [R] (the first always)."""
    ranks = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    return (ranks[None, :] < top_k[:, None]) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero all but the top-k tokens and the smallest prefix of mass >= top_p; renormalised. probs: [V]."""
    if top_k == -1 and top_p >= 1.0:
        return probs
    top_k = top_k if top_k != -1 else probs.shape[-1]
    out = filter_probs_batch(probs[None], torch.tensor([top_k]), torch.tensor([float(top_p)]))[0]
    return out / out.sum()


def filter_probs_batch(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero, row by row, what top-k [R] (long; >= V keeps all) and top-p [R] drop. probs [R, V]; not renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = _keep_mask(sorted_p, top_k.to(probs.device), top_p.to(probs.device))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row: the first index whose cumulative probability exceeds u * total. probs [R, V], u [R] in
    [0, 1) (float64). Zero-probability tokens are never picked; the sum need not be 1."""
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_token(logits: torch.Tensor, params: SamplingParams, rng: random.Random) -> tuple[int, float]:
    """The one-row reference of `sample_batch`: pick the next token from fp32 logits [V] with a plain loop over
    the cumulative probabilities; returns (token id, its log-prob).

    The log-prob is that of the chosen token under softmax(logits / T) before top-k/top-p filtering, exactly
    `compute_log_probs(logits, ids, T)` with T = 1 for greedy decoding.
    """
    logits = logits.float()
    if params.temperature == 0:
        token = int(logits.argmax())
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_k != -1 or params.top_p < 1.0:
            top_k = params.top_k if params.top_k != -1 else probs.shape[-1]
            probs = filter_probs_batch(probs[None], torch.tensor([top_k]), torch.tensor([params.top_p]))[0]
        probs = probs.tolist()
        target = rng.random() * sum(probs)
        token, acc = len(probs) - 1, 0.0
        for i, p in enumerate(probs):
            acc += p
            if acc > target:
                token = i
                break
    logprob = compute_log_probs(
        logits[None], torch.tensor([token], device=logits.device), params.logprob_temperature
    )
    return token, float(logprob[0])


def _per_row(values: list[float], device: torch.device) -> float | torch.Tensor:
    """A scalar when every row has the same value (broadcasts for free), else a column [R, 1]."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, device=device)[:, None]


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of fp32 logits [R, V]; returns (token ids, their log-probs), as `sample_token`.

    Only each row's uniform draw runs in a Python loop; softmax, filtering, the CDF search and the log-probs
    are batched. Log-probs are those of the chosen tokens under softmax(logits / T) before filtering (T = 1 for
    greedy rows), computed as the trainer computes them (`compute_log_probs`).
    """
    logits = logits.float()
    rows, vocab = logits.shape
    if rows == 0:
        return [], []
    device = logits.device
    # logits / T once: log-probs use it, and sampling rows draw from its softmax (T = 1 for greedy rows)
    temps = [p.logprob_temperature for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / _per_row(temps, device)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens: torch.Tensor | None = scaled.argmax(-1) if len(sampled) < rows else None  # greedy rows
    if sampled:
        idx = None if len(sampled) == rows else torch.tensor(sampled, device=device)
        probs = torch.softmax(scaled if idx is None else scaled.index_select(0, idx), dim=-1)
        sub_params = [params[i] for i in sampled]
        filtered = [j for j, p in enumerate(sub_params) if p.top_k != -1 or p.top_p < 1.0]
        if filtered:
            fidx = torch.tensor(filtered, device=device)
            top_k = [sub_params[j].top_k if sub_params[j].top_k != -1 else vocab for j in filtered]
            top_p = [float(sub_params[j].top_p) for j in filtered]
            probs[fidx] = filter_probs_batch(
                probs.index_select(0, fidx), torch.tensor(top_k), torch.tensor(top_p)
            )
        u = torch.tensor([rngs[i].random() for i in sampled], dtype=torch.float64, device=device)
        picked = inverse_cdf(probs, u)
        if idx is None:
            tokens = picked
        else:
            assert tokens is not None  # some rows are greedy
            tokens[idx] = picked
    assert tokens is not None  # every row was either greedy or sampled
    return tokens.tolist(), compute_log_probs(scaled, tokens, 1.0).tolist()
