"""Deterministic per-request seeds: the rollout sends SGLang's `sampling_params.sampling_seed` derived from
(--rollout-seed, request id = rollout id + sample index [+ turn]); the embedded engine seeds the request's sampler
from it, independent of which engine (server seed) and which request id serves it."""

from __future__ import annotations

import random

import pytest

from miles.engines.local.sampling import SamplingParams, request_rng
from miles.rollout.generate_output import request_seed


def test_request_seed_is_a_pure_function_of_seed_and_request_id():
    assert request_seed(42, "rollout3-7") == request_seed(42, "rollout3-7")
    seeds = {request_seed(s, f"rollout{r}-{i}") for s in (0, 42) for r in range(4) for i in range(16)}
    assert len(seeds) == 2 * 4 * 16  # distinct per (seed, rollout, sample)
    assert all(0 <= x < 2**31 for x in seeds)


def test_embedded_engine_sampler_follows_sampling_seed_not_engine_or_rid():
    def draws(rng: random.Random) -> list[float]:
        return [rng.random() for _ in range(8)]

    same = [draws(request_rng(engine_seed, rid, 1234)) for engine_seed, rid in ((42, "a"), (43, "b"))]
    assert same[0] == same[1]
    assert draws(request_rng(42, "a", 1235)) != same[0]
    # without a sampling_seed: (server seed, rid) as before
    assert draws(request_rng(42, "a")) == draws(request_rng(42, "a"))
    assert draws(request_rng(42, "a")) != draws(request_rng(43, "a"))


def test_sampling_seed_is_validated():
    assert SamplingParams.from_dict({"sampling_seed": 7}).sampling_seed == 7
    for bad in (-1, 1.5, "7", True):
        with pytest.raises(ValueError, match="sampling_seed="):
            SamplingParams.from_dict({"sampling_seed": bad})
