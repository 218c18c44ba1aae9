"""Agents as rollout functions: the generate function of `--use-session-server` (`generate_with_agent`).

Per sample it opens a session on the session server of the rollout's generate client (started on first use
and stopped when the client closes), then awaits the agent, `--agent-function-path`:

    async def run(base_url: str, sample: Sample, ctx: AgentContext) -> float | dict | None

The agent talks to `base_url` with any OpenAI client (`AsyncOpenAI(base_url=base_url, api_key=ctx.api_key)`);
`sample.prompt` and `sample.label` are the dataset row's. The episode has `--agent-timeout` seconds; each engine
request has `--rollout-request-timeout`.

The session's tree (an edited history or `n > 1` gives it several leaves) becomes samples through the sample
picker and post-processor (`--session-sample-picker-path`, `--session-sample-postprocessor-path`; defaults:
superseded retries dropped, exactly-once completion masking, see `picking`). A training episode returns all
of them, the episode's own first (by default the most recent leaf): the rollout group of a prompt holds every
picked leaf of its sessions (`--n-samples-per-prompt` sessions, at least that many samples); the others carry
`metadata["session_extra"] = True`. An evaluation episode returns the first only (one sample per episode).
`metadata["session"]` (on the first) describes the tree and counts the samples. The leaves of a session share
its reward: the agent's return value when not None, else the configured reward function's, which scores the
first sample only (`default_rollout` copies it to the others).
An agent that raises or runs past its deadline fails that sample only: status FAILED, reward 0.0 (the
convention of `--rm-error-as-zero`), the error in `metadata["agent_error"]`, the tokens of its last leaf kept
when it made a request (else an empty response). When the rollout is ending (the client stopped taking
requests) a failed episode is ABORTED instead.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.rollout.generate import request_id
from miles.rollout.rm_hub.scoring import check_reward
from miles.rollout.session.picking import build_samples, mask_exactly_once, pick_leaves
from miles.rollout.session.recorder import Session, to_sample
from miles.rollout.session.server import SessionServer
from miles.utils.deadline import DeadlineExceeded, call_with_deadline
from miles.utils.types import Sample, SampleStatus

if TYPE_CHECKING:
    from miles.rollout.base_types import AgentSettings, GenerateContext, SamplingSettings
    from miles.rollout.generate_client import GenerateClient

logger = logging.getLogger(__name__)

_SERVERS: weakref.WeakKeyDictionary[GenerateClient, SessionServer] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AgentContext:
    """What an agent gets besides its base URL and sample."""

    api_key: str | None  # the session server's key (Bearer)
    session_id: str
    evaluation: bool
    timeout: float  # the episode's deadline in seconds (--agent-timeout)


async def session_server(
    client: GenerateClient, tokenizer: object, sampling: SamplingSettings
) -> SessionServer:
    """The session server in front of `client` (started on first use, stopped when the client closes)."""
    server = _SERVERS.get(client)
    if server is None:
        server = SessionServer(client, tokenizer, sampling, strict_sampling=True)
        _SERVERS[client] = server
        await server.start()
        client.on_close.append(server.stop)
    return server


def _fail(sample: Sample, recorder: Session, error: str, aborted: bool) -> None:
    leaves = recorder.leaves()
    if leaves:
        to_sample(leaves[-1], sample)
    sample.status = SampleStatus.ABORTED if aborted else SampleStatus.FAILED
    sample.reward = None if aborted else 0.0
    sample.metadata["agent_error"] = error


async def _run_agent(
    settings: AgentSettings, base_url: str, sample: Sample, actx: AgentContext, phase: str
) -> object:
    what = (
        f"{phase}: agent {settings.name} did not finish within {settings.timeout:g}s (--agent-timeout) "
        f"for sample index {sample.index}"
    )
    return await call_with_deadline(settings.run, base_url, sample, actx, timeout=settings.timeout, what=what)


async def generate_with_agent(
    client: GenerateClient, sample: Sample, sampling: SamplingSettings, ctx: GenerateContext
) -> Sample | list[Sample]:
    """Run the agent of `--agent-function-path` for one sample (see the module docstring)."""
    settings = ctx.agent
    if settings is None:
        raise ValueError(
            "miles.rollout.session.agent.generate_with_agent needs --use-session-server and --agent-function-path"
        )
    server = await session_server(client, ctx.tokenizer, sampling)
    rid = request_id(ctx, sample)
    session_id = f"{rid}-{secrets.token_hex(4)}"
    recorder = server.open(session_id, sample.index, rid, sampling)
    actx = AgentContext(server.api_key, session_id, ctx.evaluation, settings.timeout)
    try:
        reward = await _run_agent(settings, server.base_url(session_id), sample, actx, ctx.phase)
    except (Exception, DeadlineExceeded) as e:  # noqa: BLE001 - the agent's failure is its sample's
        logger.warning(
            "%s: agent %s failed on sample index %d: %s", ctx.phase, settings.name, sample.index, e
        )
        _fail(sample, recorder, f"{type(e).__name__}: {e}", aborted=client.stopped)
        return sample
    finally:
        server.close(session_id)
    leaves = recorder.leaves()
    if not leaves:
        _fail(sample, recorder, "the agent made no chat completion request", aborted=client.stopped)
        return sample
    decode = lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    picked = build_samples(
        recorder, sample, settings.pick or pick_leaves, settings.postprocess or mask_exactly_once, decode
    )
    if not picked:
        _fail(sample, recorder, "the session sample picker kept no leaf", aborted=False)
        return sample
    sample = picked[0]
    sample.metadata["session"] = {
        "leaves": len(leaves),
        "samples": len(picked),
        "lineages": recorder.lineages,
        "requests": recorder.requests,
        "turns": len(recorder.nodes[sample.metadata.get("session_leaf", leaves[-1].id)].turns),
        "tree": recorder.tree(),
    }
    picked = picked[:1] if ctx.evaluation else picked
    for extra in picked[1:]:
        extra.metadata["session_extra"] = True
    if reward is not None:
        value = check_reward(reward, settings.name, sample)
        for s in picked:
            s.reward = dict(value) if isinstance(value, dict) else value
    elif not settings.has_reward_fn:  # that sample's failure (as a crash would be), not the run's
        error = (
            f"agent {settings.name} (--agent-function-path) returned None for sample index {sample.index} and "
            "no reward function is set: return the reward, or set --custom-rm-path, --rm-type or --rm-url"
        )
        logger.warning("%s: %s", ctx.phase, error)
        for s in picked:
            s.status, s.reward = SampleStatus.FAILED, 0.0
            s.metadata["agent_error"] = error
    return picked if len(picked) > 1 else sample
