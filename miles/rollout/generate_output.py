"""What one SGLang `/generate` answer says (`GenerateOutput`: new token ids, their log-probs, text, finish reason,
the weight versions that produced them, routed experts) and the per-request sampling seed. Pure: no HTTP here;
`miles.rollout.generate_client` sends the requests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class GenerateOutput:
    """One /generate answer (SGLang's fields): new token ids, their log-probs, text and why it stopped."""

    output_ids: list[int]
    log_probs: list[float] | None  # [len(output_ids)], None when the engine returned none
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None = None
    span_versions: tuple[str, ...] = ()  # meta_info.weight_versions' non-empty spans' versions, in order
    routed_experts: str | None = (
        None  # SGLang's base64 int32 [seqlen - 1, layers, top_k] (return_routed_experts)
    )

    @classmethod
    def from_response(cls, body: dict, where: str) -> GenerateOutput:
        """Parse a /generate JSON body; ValueError naming `where` when ids and log-probs disagree."""
        meta = body.get("meta_info") or {}
        logprobs = meta.get("output_token_logprobs")
        output_ids = body.get("output_ids")
        if output_ids is None:  # servers that report the ids only inside the log-prob triples
            output_ids = [int(entry[1]) for entry in logprobs or []]
        if logprobs is not None and len(logprobs) != len(output_ids):
            raise ValueError(f"{where}: {len(output_ids)} output ids but {len(logprobs)} log-probs")
        finish = (meta.get("finish_reason") or {}).get("type", "stop")
        if finish not in FINISH_REASONS:
            raise ValueError(
                f"{where}: unknown finish_reason type {finish!r}; expected one of {FINISH_REASONS}"
            )
        version, spans = meta.get("weight_version"), meta.get("weight_versions") or []
        return cls(
            output_ids=[int(t) for t in output_ids],
            log_probs=[float(entry[0]) for entry in logprobs] if logprobs is not None else None,
            text=body.get("text", ""),
            finish_reason=finish,
            weight_version=None if version is None else str(version),
            span_versions=tuple(str(s["version"]) for s in spans if s["end"] > s["start"]),
            routed_experts=meta.get("routed_experts"),
        )


def request_seed(seed: int, rid: str) -> int:
    """The `sampling_seed` of request `rid` in a run seeded with `seed` (31 bits: a valid int everywhere).

    Request ids name the rollout, the sample index and the turn, so a sample draws the same tokens whichever
    engine serves it, and in a resumed run as in a straight one."""
    digest = hashlib.sha256(f"{seed}:{rid}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


ABORTED_BEFORE_SENDING = GenerateOutput(output_ids=[], log_probs=[], text="", finish_reason="abort")
