"""Sampling parameters (SGLang's `sampling_params` field names) and the per-request sampler."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from miles.algo.logprobs import compute_log_probs

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
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Validate a JSON `sampling_params` object; ValueError names each bad key and what is allowed."""
        d = dict(d or {})
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
        kw = {k: v for k, v in d.items() if k in known and v is not None}
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


def request_generator(random_seed: int, rid: str, sampling_seed: int | None = None) -> torch.Generator:
    """A CPU generator seeded from the request's `sampling_seed` when it has one (the same answer on every
    engine), else from (server seed, request id); either way a request's samples are reproducible."""
    gen = torch.Generator()
    if sampling_seed is not None:
        gen.manual_seed(int(sampling_seed))
        return gen
    digest = hashlib.sha256(f"{random_seed}:{rid}".encode()).digest()
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero all but the top-k tokens and the smallest prefix of mass >= top_p; renormalised. probs: [V]."""
    if top_k == -1 and top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k != -1:
        keep[top_k:] = False
    if top_p < 1.0:
        mass_before = sorted_p.cumsum(0) - sorted_p
        keep &= mass_before < top_p  # the first token is always kept
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Pick the next token from fp32 logits [V]; returns (token id, its log-prob).

    The log-prob is that of the chosen token under softmax(logits / T) before top-k/top-p filtering, exactly
    `compute_log_probs(logits, ids, T)` with T = 1 for greedy decoding.
    """
    logits = logits.float()
    if params.temperature == 0:
        token = int(logits.argmax())
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        probs = filter_probs(probs, params.top_k, params.top_p)
        token = int(torch.multinomial(probs, 1, generator=generator))
    logprob = compute_log_probs(logits[None], torch.tensor([token]), params.logprob_temperature)
    return token, float(logprob[0])
