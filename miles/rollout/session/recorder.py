"""The token-in, token-out recorder of one session: a tree of conversation states, each leaf a training sample.

A node is the conversation after one sampled assistant turn: its messages (normalized, see `chat`), its token
ids (the lineage's prompt followed by every response token), and per response token the loss mask (1: sampled
by the policy, 0: the environment's: tool results, user turns, template glue) and the rollout log-prob (the
engine's for sampled tokens, 0.0 otherwise); per turn the request's input ids, the sampled ids, their
log-probs and the weight version that sampled them (`TurnRecord`).

How a request's input ids are built (`Session.prepare`):
  1. the parent is the deepest node whose messages are a prefix of the request's (assistant messages compared
     with what the server answered), with no assistant message among the rest;
  2. with a parent, the chat template renders the parent's messages (no generation prompt) and the request's
     (with one); the first must be a prefix of the second (else: a new lineage, step 3). The input ids are the
     parent's tokens, exactly as held (sampled tokens are never re-tokenized), then the EOS token when the
     sampled turn did not end with it, then the tokens of the text the template puts after the assistant's
     end-of-turn marker (e.g. "\\n") followed by the rendering of the new messages and the generation prompt;
  3. without a parent (the first request, or a history the agent edited: dropped, rewritten or compacted
     turns), the rendered conversation is tokenized whole and starts a new lineage that branches off the node
     sharing the longest common token prefix with it (`branch_of`, `fork_at`): when that prefix covers the
     node's prompt, the new lineage keeps the node's prompt length and, over the shared tokens, the node's
     loss mask and log-probs (they are the same tokens, sampled by the policy where the mask is 1); the rest
     is environment (mask 0). Otherwise (a different prompt, or the first request) it is a new root, all prompt.
`Session.record` adds one child node per sampled choice (`n` choices: `n` siblings). Every node without a child
is a leaf (a branch does not make its `branch_of` node a parent); `to_sample` turns one into a `Sample`.
`owners` tells, per response token, which node's turn sampled it (-1: the environment's), so a token shared by
several leaves is recognizable (see `picking`: exactly-once completion masking).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from miles.rollout.session.chat import Message, same_message
from miles.utils.types import Sample, SampleStatus


@dataclass
class TurnRecord:
    """One sampled assistant turn: what the engine was given and what it sampled."""

    prompt_ids: list[int]  # the request's input ids
    output_ids: list[int]  # the sampled ids, as the engine returned them
    log_probs: list[float]  # [len(output_ids)]
    weight_version: str | None
    finish_reason: str  # the engine's: "stop" | "length" | "abort"


@dataclass
class Node:
    """The conversation after one sampled turn (see the module docstring)."""

    id: int
    parent: int | None
    messages: list[Message]  # through this node's assistant message
    tokens: list[int]  # [prompt_len + response length]
    prompt_len: int
    loss_mask: list[int]  # [response length]
    log_probs: list[float]  # [response length]
    weight_versions: list[str]
    turns: list[TurnRecord]  # the turns of this lineage, oldest first
    ends_with_eos: bool
    owners: list[int]  # [response length]: the id of the node whose turn sampled the token; -1: environment
    request: int = 0  # the session's request number that sampled this node
    branch_of: int | None = None  # the node a new lineage branched off (longest common token prefix)
    fork_at: int = 0  # with branch_of: the length of the shared token prefix
    children: int = 0

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True)
class Prepared:
    """A request's input ids and where they extend the tree."""

    parent: Node | None
    input_ids: list[int]
    prompt_len: int  # the lineage's prompt length
    loss_mask: list[int]  # [len(input_ids) - prompt_len]
    log_probs: list[float]
    owners: list[int]  # [len(input_ids) - prompt_len], see Node.owners
    branch_of: int | None = None
    fork_at: int = 0
    request: int = 0  # the session's request number (set by `Session.prepare`)


@dataclass
class Session:
    """The recorder of one session (one agent episode); `tokenizer` is a transformers tokenizer."""

    session_id: str
    tokenizer: Any
    nodes: list[Node] = field(default_factory=list)
    requests: int = 0
    lineages: int = 0  # requests that started a new lineage (a root of the tree; its n choices are siblings)

    def render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def find_parent(self, messages: list[Message]) -> Node | None:
        """The deepest node the request's messages extend (step 1 of the module docstring), or None."""
        best: Node | None = None
        for node in self.nodes:
            k = len(node.messages)
            if k > len(messages) or (best is not None and k <= len(best.messages)):
                continue
            if any(m["role"] == "assistant" for m in messages[k:]):
                continue
            if all(same_message(a, b) for a, b in zip(node.messages, messages[:k])):
                best = node
        return best

    def prepare(self, messages: list[Message], tools: list[dict] | None) -> Prepared:
        """The input ids of a request with `messages` (and `tools`), per the module docstring."""
        full = self.render(messages, tools, generation_prompt=True)
        request = self.requests
        self.requests += 1
        parent = self.find_parent(messages)
        if parent is not None:
            before = self.render(parent.messages, tools, generation_prompt=False)
            if full.startswith(before):
                return replace(self._extend(parent, before, full), request=request)
        self.lineages += 1
        return replace(self._branch(self._encode(full)), request=request)

    def _branch(self, ids: list[int]) -> Prepared:
        """A new lineage of input `ids`, branching off the node with the longest common token prefix."""
        best, shared = None, 0
        for node in self.nodes:
            k = _common_prefix(node.tokens, ids)
            if k > shared:
                best, shared = node, k
        if best is None or shared < best.prompt_len:
            return Prepared(None, ids, len(ids), [], [], [])
        kept, rest = shared - best.prompt_len, len(ids) - shared
        return Prepared(
            None,
            ids,
            best.prompt_len,
            best.loss_mask[:kept] + [0] * rest,
            best.log_probs[:kept] + [0.0] * rest,
            best.owners[:kept] + [-1] * rest,
            best.id,
            shared,
        )

    def _extend(self, parent: Node, before: str, full: str) -> Prepared:
        tok = self.tokenizer
        eos_text, eos_id = tok.eos_token or "", tok.eos_token_id
        closing: list[int] = [] if parent.ends_with_eos or eos_id is None else [int(eos_id)]
        after_eos = (
            before[before.rfind(eos_text) + len(eos_text) :] if eos_text and eos_text in before else ""
        )
        new = self._encode(after_eos + full[len(before) :])
        added = closing + new
        return Prepared(
            parent,
            parent.tokens + added,
            parent.prompt_len,
            parent.loss_mask + [0] * len(added),
            parent.log_probs + [0.0] * len(added),
            parent.owners + [-1] * len(added),
        )

    def record(
        self,
        prepared: Prepared,
        messages: list[Message],
        assistant: Message,
        turn: TurnRecord,
    ) -> Node:
        """Add the node of one sampled choice (a child of the request's parent, or a new root)."""
        parent = prepared.parent
        if parent is not None:
            parent.children += 1
        out, lps = turn.output_ids, turn.log_probs
        if len(lps) != len(out):
            raise ValueError(f"session {self.session_id}: {len(out)} sampled ids but {len(lps)} log-probs")
        versions = list(parent.weight_versions) if parent is not None else []
        if turn.weight_version is not None:
            versions.append(turn.weight_version)
        eos_id = self.tokenizer.eos_token_id
        node = Node(
            id=len(self.nodes),
            parent=None if parent is None else parent.id,
            messages=[*messages, assistant],
            tokens=prepared.input_ids + list(out),
            prompt_len=prepared.prompt_len,
            loss_mask=prepared.loss_mask + [1] * len(out),
            log_probs=prepared.log_probs + [float(x) for x in lps],
            weight_versions=versions,
            turns=[*(parent.turns if parent is not None else []), turn],
            ends_with_eos=bool(out) and eos_id is not None and out[-1] == eos_id,
            owners=prepared.owners + [len(self.nodes)] * len(out),
            request=prepared.request,
            branch_of=prepared.branch_of if parent is None else parent.branch_of,
            fork_at=prepared.fork_at if parent is None else parent.fork_at,
        )
        self.nodes.append(node)
        return node

    def leaves(self) -> list[Node]:
        """The nodes without a child, oldest first: one training sample each."""
        return [n for n in self.nodes if n.children == 0]

    def tree(self) -> list[dict[str, Any]]:
        """The tree as JSON-able records (for sample metadata and debug dumps)."""
        return [
            {
                "id": n.id,
                "parent": n.parent,
                "leaf": n.children == 0,
                "prompt_len": n.prompt_len,
                "response_length": n.response_length,
                "weight_versions": n.weight_versions,
                "request": n.request,
                "branch_of": n.branch_of,
                "fork_at": n.fork_at,
            }
            for n in self.nodes
        ]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


FINISH_TO_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}


def to_sample(node: Node, base: Sample, decode: Any = None) -> Sample:
    """`base` (the dataset's sample) filled with leaf `node`'s tokens, loss mask, log-probs and weight versions;
    status COMPLETED unless its last turn ran out of tokens (TRUNCATED)."""
    base.tokens = list(node.tokens)
    base.response_length = node.response_length
    base.loss_mask = list(node.loss_mask)
    base.rollout_log_probs = list(node.log_probs)
    base.weight_versions = list(node.weight_versions)
    base.status = FINISH_TO_STATUS.get(node.turns[-1].finish_reason, SampleStatus.COMPLETED)
    if decode is not None:
        base.response = decode(node.tokens[node.prompt_len :])
    return base
