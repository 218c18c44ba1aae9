"""The embedded engine's output processor: a finished request becomes SGLang's /generate answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NotRequired, TypedDict

from miles.engines.local.scheduler import FinishReason, Request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class MetaInfo(TypedDict):
    """SGLang's `meta_info` of a /generate answer (the fields the embedded engine fills)."""

    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float
    output_token_logprobs: NotRequired[list[list[float | int | str | None]]]  # [logprob, token id, text]


class GenerateAnswer(TypedDict):
    """One /generate answer: SGLang's `text`, `output_ids` and `meta_info`."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class OutputProcessor:
    """Detokenizes and formats answers: `text`, `output_ids`, `meta_info` (field names as in SGLang)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, weight_version_fn: Callable[[], str]):
        self.tokenizer = tokenizer
        self._weight_version_fn = weight_version_fn

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Text of `ids`."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def answer(self, req: Request) -> GenerateAnswer:
        """The answer dict of a finished request."""
        p, fr = req.params, req.finish_reason
        assert fr is not None, f"request {req.rid} is not finished"
        ids = req.output_ids
        if fr["type"] == "stop" and isinstance(fr.get("matched"), int) and not p.no_stop_trim:
            text = self.detokenize(ids[:-1], p.skip_special_tokens)
        else:
            text = self.detokenize(ids, p.skip_special_tokens)
            if req.stop_text_end is not None and not p.no_stop_trim:
                text = text[: req.stop_text_end]
        meta: MetaInfo = {
            "id": req.rid,
            "finish_reason": fr,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": self._weight_version_fn(),
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_logprob:
            texts = (
                [self.detokenize([t], False) for t in ids]
                if req.return_text_in_logprobs
                else [None] * len(ids)
            )
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(req.logprobs, ids, texts)]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}
