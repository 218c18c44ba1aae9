"""Generation over SGLang's HTTP API: one POST /generate per sample, many in flight at once.

The same code drives SGLang servers and the embedded engine (both sit behind sglang-router). Token ids are the
currency: the prompt goes as `input_ids`, the response comes back as `output_ids` with the sampled tokens'
log-probs, and nothing is re-tokenized.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from miles.utils.types import Sample, SampleStatus


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = False

    def to_request(self) -> dict:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


_FINISH_TO_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def apply_generate_response(sample: Sample, prompt_ids: list[int], body: dict) -> None:
    """Fill a sample from a /generate answer (SGLang's response fields)."""
    meta = body.get("meta_info", {})
    logprobs = meta.get("output_token_logprobs") or []
    output_ids = body.get("output_ids")
    if output_ids is None:  # older servers only report ids inside the log-prob triples
        output_ids = [int(entry[1]) for entry in logprobs]
    if logprobs and len(logprobs) != len(output_ids):
        raise ValueError(
            f"engine returned {len(output_ids)} output ids but {len(logprobs)} log-probs for sample {sample.index}"
        )
    sample.tokens = list(prompt_ids) + [int(t) for t in output_ids]
    sample.response_length = len(output_ids)
    sample.response = body.get("text", "")
    sample.rollout_log_probs = [float(entry[0]) for entry in logprobs] if logprobs else None
    finish = (meta.get("finish_reason") or {}).get("type", "stop")
    sample.status = _FINISH_TO_STATUS.get(finish, SampleStatus.COMPLETED)
    # aborted responses carry no learning signal
    sample.loss_mask = [0 if sample.status == SampleStatus.ABORTED else 1] * sample.response_length
    version = meta.get("weight_version")
    if version is not None:
        sample.weight_versions.append(str(version))


async def _generate_one(
    client: httpx.AsyncClient,
    url: str,
    sample: Sample,
    params: dict,
    limiter: asyncio.Semaphore,
    timeout: float,
) -> None:
    prompt_ids = list(sample.tokens[: sample.prompt_length])
    payload = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}
    async with limiter:
        try:
            resp = await client.post(f"{url}/generate", json=payload, timeout=timeout)
        except httpx.TimeoutException as e:
            raise TimeoutError(
                f"rollout generate: no answer from {url}/generate within {timeout:.0f}s (sample {sample.index})"
            ) from e
    if resp.status_code != 200:
        raise RuntimeError(f"rollout generate: {url}/generate answered {resp.status_code}: {resp.text[:500]}")
    apply_generate_response(sample, prompt_ids, resp.json())


async def generate_samples(
    url: str, samples: list[Sample], settings: SamplingSettings, concurrency: int, timeout: float
) -> None:
    """Generate a response for every sample in place (prompt ids in `sample.tokens`, response_length 0)."""
    params = settings.to_request()
    limiter = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(_generate_one(client, url, s, params, limiter, timeout) for s in samples))
