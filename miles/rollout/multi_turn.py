"""The stock multi-turn generate function with tool calls (`generate_multi_turn`).

Use it with `--custom-generate-function-path miles.rollout.multi_turn.generate_multi_turn` and a tool,
`--generate-execute-tool-function-path my.module:tool` (`tool(arguments: str, sample) -> str`, sync or async; a
tool may answer with images, `{"text": str, "images": [image, ...]}`, see step 4).

The loop, per model turn:
  1. generate with the whole conversation so far as `input_ids` (prompt + earlier turns + tool answers); the
     turn stops at EOS, at the stop string `</tool_call>`, or when the response budget
     (`--rollout-max-response-len`, model and tool tokens together) is spent;
  2. the turn's tokens are appended as model tokens (loss mask 1, the engine's log-probs);
  3. a tool call in the turn is the text after its last `<tool_call>` up to `</tool_call>` (or the end of the
     turn). No call: the model has answered and the sample is COMPLETED. Otherwise the tool runs with that text
     (at most `--generate-tool-timeout` seconds; a tool that raises answers "error: <Type>: <message>"; one
     that does not return in time fails the rollout, naming the tool, the sample index and the phase);
  4. its answer is appended as tool tokens (loss mask 0, log-prob 0.0, never trained on): rendered with the
     tokenizer's chat template as a `{"role": "tool"}` message followed by the generation prompt (plain
     `<tool_response>...</tool_response>` lines without a template), after the EOS token when the model's turn
     did not end with one. A tool answer with images (a vision-language checkpoint; DeepEyes-style zoom/crop
     tools, issue 27) is the tool message `[image parts..., text]` rendered by the chat template, each image's
     pad expanded by the checkpoint's image processor as in prompts; the images are appended to
     `multimodal_data["image"]` and every later request carries all the sample's images (miles.rollout.vl_request),
     the trainer reads them in the same order (3-D positions: miles.utils.vl_positions). Such an answer is
     appended whole or not at all (TRUNCATED when it does not fit the budget, or when the response so far holds an
     image/video pad the policy sampled);
  5. repeat until the model answers, `--generate-max-turns` model turns were taken (status TRUNCATED if the
     last one still called a tool), or the budget is spent (TRUNCATED).

A sample aborted mid-turn (partial rollout) is continued by the next call from where it stopped. The
sample's `metadata` records `turns` (model turns), `tool_calls`, and `final_turn` (the text of the last model
turn, which is what a reward function usually scores); `response` is the decoded whole response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.rollout.base_types import GenerateContext, MultiTurnSettings, SamplingSettings
from miles.rollout.generate import FINISH_TO_STATUS, record_versions, request_id
from miles.rollout.generate_client import GenerateClient
from miles.rollout.multimodal import VLProcessor, image_data_uri, load_image
from miles.rollout.vl_request import IMAGE_PAD, engine_prompt
from miles.utils.deadline import DeadlineExceeded, call_with_deadline
from miles.utils.types import Sample, SampleStatus

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class ToolTimeoutError(DeadlineExceeded):
    """A tool did not answer within --generate-tool-timeout."""


def parse_tool_call(turn_text: str, eos_text: str | None = None) -> str | None:
    """The arguments of the last `<tool_call>` in a model turn (stripped), or None when it calls no tool."""
    start = turn_text.rfind(TOOL_CALL_OPEN)
    if start < 0:
        return None
    body = turn_text[start + len(TOOL_CALL_OPEN) :]
    end = body.find(TOOL_CALL_CLOSE)
    if end >= 0:
        body = body[:end]
    if eos_text:
        body = body.replace(eos_text, "")
    return body.strip()


def render_tool_answer(tokenizer: object, answer: str | list[dict[str, Any]], after_eos: bool) -> str:
    """The text appended after a model turn for a tool's answer (see the module docstring); `answer` is the
    tool message's content (a list of parts when it carries images: the chat template places them)."""
    eos = getattr(tokenizer, "eos_token", None) or ""
    prefix = "\n" if after_eos or not eos else eos + "\n"
    if getattr(tokenizer, "chat_template", None):
        body = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "tool", "content": answer}], tokenize=False, add_generation_prompt=True
        )
        return prefix + body
    return prefix + f"<tool_response>\n{answer}\n</tool_response>\n"


@dataclass
class ToolAnswer:
    """A tool's answer: its text and the images it carries (anything `miles.rollout.multimodal.load_image`
    reads: a PIL image, a data URI, base64, bytes, a path)."""

    text: str
    images: list[Any] = field(default_factory=list)


def _answer_of(value: object, what: str) -> ToolAnswer:
    """The ToolAnswer of a tool's return value: a str, or a dict {"text": str, "images": [image, ...]}."""
    if isinstance(value, str):
        return ToolAnswer(value)
    if isinstance(value, dict) and set(value) <= {"text", "images"}:
        text, images = value.get("text", ""), value.get("images", [])
        if isinstance(text, str) and isinstance(images, list):
            return ToolAnswer(text, images)
    raise ValueError(
        f"{what} returned {type(value).__name__}; expected a str or a dict {{'text': str, 'images': list}}"
    )


async def run_tool(settings: MultiTurnSettings, arguments: str, sample: Sample, phase: str) -> ToolAnswer:
    """Call the tool with a deadline. Exceptions become the answer text; a timeout raises ToolTimeoutError."""

    what = (
        f"{phase}: tool {settings.tool_name} gave no answer within {settings.tool_timeout:g}s "
        f"(--generate-tool-timeout) for sample index {sample.index}"
    )
    try:
        answer = await call_with_deadline(
            settings.tool, arguments, sample, timeout=settings.tool_timeout, what=what
        )
    except DeadlineExceeded as e:
        raise ToolTimeoutError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a tool error is the tool's answer, the model sees it
        return ToolAnswer(f"error: {type(e).__name__}: {e}")
    return _answer_of(answer, f"{phase}: tool {settings.tool_name} for sample index {sample.index}")


def tool_answer_ids(tok: Any, answer: ToolAnswer, after_eos: bool, what: str) -> tuple[list[int], list[str]]:
    """(token ids, image data URIs) of a tool answer: with images, the chat template places one image part per
    image before the text and each image's pad is expanded by the checkpoint's image processor, as in prompts."""
    if not answer.images:
        return tok(render_tool_answer(tok, answer.text, after_eos), add_special_tokens=False)["input_ids"], []
    if not getattr(tok, "chat_template", None) or IMAGE_PAD not in tok.get_vocab():
        raise ValueError(
            f"{what}: the tool (--generate-execute-tool-function-path) returned images, which needs a "
            f"vision-language --hf-checkpoint with a chat template (issue 27)"
        )
    images = [load_image(v, f"{what}: tool answer image {j}") for j, v in enumerate(answer.images)]
    proc = _processor(tok)
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": answer.text}]
    text = proc.expand_pads(render_tool_answer(tok, content, after_eos), proc.process_images(images))
    return tok(text, add_special_tokens=False)["input_ids"], [image_data_uri(i) for i in images]


_PROCESSORS: dict[int, VLProcessor] = {}


def _processor(tok: Any) -> VLProcessor:
    """The VLProcessor of the checkpoint `tok` was loaded from (one per tokenizer)."""
    if id(tok) not in _PROCESSORS:
        _PROCESSORS[id(tok)] = VLProcessor.for_tokenizer(tok)
    return _PROCESSORS[id(tok)]


def _holds_placeholders(tok: Any, ids: list[int]) -> bool:
    """Whether `ids` hold an image or video pad (one the policy sampled: an image appended after it would not be
    the sequence's next image pad run, see miles.utils.vl_positions)."""
    vocab = tok.get_vocab()
    pads = {vocab[t] for t in (IMAGE_PAD, "<|video_pad|>") if t in vocab}
    return any(t in pads for t in ids)


async def generate_multi_turn(
    client: GenerateClient, sample: Sample, sampling: SamplingSettings, ctx: GenerateContext
) -> Sample:
    """Generate (or continue) a multi-turn response with tool calls (see the module docstring)."""
    settings = ctx.multi_turn
    if settings is None:
        raise ValueError(
            "miles.rollout.multi_turn.generate_multi_turn needs a tool: set --generate-execute-tool-function-path"
        )
    tok = ctx.tokenizer
    eos_id, eos_text = tok.eos_token_id, tok.eos_token
    stop = list(sampling.stop or []) + [TOOL_CALL_CLOSE]
    meta = sample.metadata
    meta.setdefault("turns", 0)
    meta.setdefault("tool_calls", 0)
    turn_start = meta.setdefault("turn_start", sample.response_length)  # where the current model turn began
    request = 0
    while not sample.is_finished:
        remaining = sampling.max_new_tokens - sample.response_length
        if remaining <= 0:
            sample.status = SampleStatus.TRUNCATED
            break
        params = sampling.to_request(remaining)
        params["stop"] = stop
        input_ids, images = engine_prompt(sample, tok)  # all images so far, one pad each (vl_request)
        out = await client.generate(
            input_ids,
            params,
            sample.index,
            ctx.phase,
            rid=request_id(ctx, sample, request),
            image_data=images,
        )
        request += 1
        sample.append_tokens(out.output_ids, out.log_probs, trainable=True)
        record_versions(sample, out)
        status = FINISH_TO_STATUS[out.finish_reason]
        if status == SampleStatus.ABORTED:  # continued by a later call from here, mid-turn
            sample.status = status
            break
        turn_ids = sample.response_ids[turn_start:]
        turn_text = tok.decode(turn_ids, skip_special_tokens=False)
        meta["turns"] += 1
        meta["final_turn"] = turn_text
        arguments = parse_tool_call(turn_text, eos_text)
        if status == SampleStatus.TRUNCATED or arguments is None:
            sample.status = status  # out of budget, or the model answered
            break
        if meta["turns"] >= settings.max_turns:
            sample.status = SampleStatus.TRUNCATED
            break
        answer = await run_tool(settings, arguments, sample, ctx.phase)
        meta["tool_calls"] += 1
        after_eos = bool(turn_ids) and turn_ids[-1] == eos_id
        ids, uris = tool_answer_ids(tok, answer, after_eos, f"{ctx.phase}: sample index {sample.index}")
        room = sampling.max_new_tokens - sample.response_length
        if uris and (len(ids) > room or _holds_placeholders(tok, sample.response_ids)):
            sample.status = (
                SampleStatus.TRUNCATED
            )  # an image is appended whole, after no sampled pad, or not at all
            break
        sample.append_tokens(ids[:room], None, trainable=False)
        if uris:
            sample.multimodal_data = {**(sample.multimodal_data or {})}
            sample.multimodal_data["image"] = list(sample.multimodal_data.get("image") or []) + uris
        sample.status = SampleStatus.TRUNCATED if len(ids) >= room else SampleStatus.PENDING
        turn_start = meta["turn_start"] = sample.response_length
    sample.response = tok.decode(sample.response_ids, skip_special_tokens=sampling.skip_special_tokens)
    return sample
