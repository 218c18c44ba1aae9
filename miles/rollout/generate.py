"""The stock single-turn generate function (the default `GenerateFn`) and helpers shared by generate functions.

One generation per sample (`GenerateClient.generate`; the stock rollout batches a group's requests, or those of
all the groups it launches at once when it needs every one of them: see `default_rollout`). Token ids are the currency:
the prompt (and any partial response from an aborted earlier attempt) goes as `input_ids`, the response comes back
as `output_ids` with the sampled tokens' log-probs, and nothing is re-tokenized.
"""

from __future__ import annotations

from miles.rollout.base_types import GenerateContext, SamplingSettings
from miles.rollout.generate_client import GenerateClient
from miles.rollout.generate_output import GenerateOutput
from miles.rollout.vl_request import engine_prompt
from miles.utils.routed_experts import decode_routed_experts
from miles.utils.types import Sample, SampleStatus

__all__ = ["SamplingSettings", "apply_output", "generate_single_turn", "request_id"]

FINISH_TO_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def request_id(ctx: GenerateContext, sample: Sample, turn: int = 0) -> str:
    """A request id unique within the run (rollout id, sample index, turn within this call): the engine seeds
    its sampling from it, so a rollout is reproducible."""
    base = f"{ctx.request_id_prefix}-{sample.index}"
    return base if turn == 0 else f"{base}-t{turn}"


def apply_output(sample: Sample, out: GenerateOutput) -> None:
    """Append a /generate answer to `sample` as model tokens (loss mask 1) and set its status.

    The answer's weight versions are recorded when the request generated anything: one segment per span of
    `meta_info.weight_versions` (a request held across a refit has two), else the answer's `weight_version`.
    """
    sample.append_tokens(out.output_ids, out.log_probs, trainable=True)
    if out.routed_experts is not None:  # R3: the whole sequence's rows so far (SGLang's start_len 0)
        sample.rollout_routed_experts = decode_routed_experts(out.routed_experts, len(sample.tokens) - 1)
    sample.response += out.text
    sample.status = FINISH_TO_STATUS[out.finish_reason]
    record_versions(sample, out)


def record_versions(sample: Sample, out: GenerateOutput) -> None:
    """Append the versions that generated `out` to `sample.weight_versions` (see `apply_output`)."""
    if out.span_versions and out.output_ids:
        sample.weight_versions.extend(out.span_versions)
    elif out.weight_version is not None and (out.output_ids or out.finish_reason != "abort"):
        sample.weight_versions.append(out.weight_version)


async def generate_single_turn(
    client: GenerateClient, sample: Sample, sampling: SamplingSettings, ctx: GenerateContext
) -> Sample:
    """Generate (or continue) one response; `sampling.max_new_tokens` bounds the whole response."""
    if sample.is_finished:
        return sample
    remaining = sampling.max_new_tokens - sample.response_length
    if remaining <= 0:
        sample.status = SampleStatus.TRUNCATED
        return sample
    input_ids, images = engine_prompt(sample, ctx.tokenizer)  # images: one pad per image (vl_request)
    out = await client.generate(
        input_ids,
        sampling.to_request(remaining),
        sample.index,
        ctx.phase,
        rid=request_id(ctx, sample),
        image_data=images,
    )
    apply_output(sample, out)
    return sample
