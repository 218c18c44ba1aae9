"""Calling a remote reward service (`--rm-url`): one POST per sample, with retries and a deadline.

Request body: `{"prompt", "response", "label", "metadata"}` (JSON). Answer: a number, or an object of numbers
(a dict reward). Each attempt waits at most `--rm-timeout` seconds; a failed attempt (no connection, timeout,
a 5xx answer) is retried up to `--rm-max-retries` times with a growing pause (0.5 s, 1 s, 2 s, ... at most
8 s); then a RuntimeError names the URL, the sample index and the last error. A 4xx answer (the service
refuses the request) fails at once. A small service that answers
this protocol ships in `miles.rollout.rm_hub.server`.
"""

from __future__ import annotations

import asyncio
import logging

from miles.rollout.rm_hub.context import RewardContext
from miles.utils.httpx_import import lean_httpx
from miles.utils.types import Sample

with lean_httpx():  # not its command-line client's imports (~0.1 s of CPU per process)
    import httpx

logger = logging.getLogger(__name__)


async def remote_reward(ctx: RewardContext, sample: Sample) -> float | dict[str, float]:
    """Score `sample` with the service at `ctx.rm_url`."""
    if not ctx.rm_url:
        raise ValueError("rm_type 'remote_rm' needs --rm-url (the reward service's URL)")
    payload = {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    }
    attempts = ctx.rm_max_retries + 1
    last = ""
    async with httpx.AsyncClient(timeout=ctx.rm_timeout) as client:
        for attempt in range(attempts):
            try:
                resp = await client.post(ctx.rm_url, json=payload)
                if resp.status_code == 200:
                    return resp.json()
                last = f"answered {resp.status_code}: {resp.text[:200]}"
                if 400 <= resp.status_code < 500:
                    raise RuntimeError(
                        f"remote reward {ctx.rm_url} refused sample index {sample.index}: {last}"
                    )
            except httpx.TimeoutException:
                last = f"no answer within {ctx.rm_timeout:.0f}s"
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt + 1 < attempts:
                pause = min(0.5 * 2**attempt, 8.0)
                logger.info(
                    "remote reward %s for sample %d: %s; retry in %.1fs",
                    ctx.rm_url,
                    sample.index,
                    last,
                    pause,
                )
                await asyncio.sleep(pause)
    raise RuntimeError(
        f"remote reward {ctx.rm_url} failed for sample index {sample.index} after {attempts} attempt(s): {last}"
    )
