"""Which leaves of a session's tree become training samples, and their loss masks (the two session hooks).

`--session-sample-picker-path module:function` (default `pick_leaves`):

    def pick(session: Session) -> list[Node]

receives the session's recorder (its tree: `session.nodes`, `session.leaves()`, each node's `turns`, `request`,
`branch_of`) and returns the leaves to train on, the episode's own sample first. The default keeps every leaf
except superseded retries (a leaf whose last turn's input ids a later request of the session sent again: the
agent retried that prompt and kept the later answer), most recent first.

`--session-sample-postprocessor-path module:function` (default `mask_exactly_once`):

    def post(samples: list[Sample], leaves: list[Node]) -> list[Sample]

receives the picked leaves as samples (in the picker's order; each a copy of the dataset's sample with the
leaf's id in `metadata["session_leaf"]`, its tokens, loss mask 1 on every token the policy sampled, rollout log-probs, weight versions, status) and
the leaves themselves, and returns the samples to train on (the first is the episode's). The default,
exactly-once completion masking, keeps loss mask 1 on a sampled token only in the first sample that holds it
(a token is identified by the node that sampled it and its position, `Node.owners`), so a token shared by
several leaves of the tree (an edited history keeps a prefix) is trained once.

Both are checked at start-up (`miles.rollout.seams.load_agent`). Every returned sample is trained: the rollout
group of a prompt holds all the samples of its sessions (see `miles.rollout.session.agent`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from miles.rollout.session.recorder import Node, Session, to_sample
from miles.utils.types import Sample

PickFn = Callable[[Session], list[Node]]
PostFn = Callable[[list[Sample], list[Node]], list[Sample]]


def superseded(session: Session) -> set[int]:
    """Ids of the leaves whose last turn's input ids a later request of the session sent again."""
    latest: dict[tuple[int, ...], int] = {}
    for node in session.nodes:
        key = tuple(node.turns[-1].prompt_ids)
        latest[key] = max(latest.get(key, -1), node.request)
    return {n.id for n in session.leaves() if latest[tuple(n.turns[-1].prompt_ids)] > n.request}


def pick_leaves(session: Session) -> list[Node]:
    """The default picker: every leaf but superseded retries, most recent first."""
    dropped = superseded(session)
    return [n for n in reversed(session.leaves()) if n.id not in dropped]


def mask_exactly_once(samples: list[Sample], leaves: list[Node]) -> list[Sample]:
    """The default post-processor: exactly-once completion masking (see the module docstring)."""
    seen: set[tuple[int, int]] = set()
    for sample, leaf in zip(samples, leaves, strict=True):
        mask = list(sample.loss_mask or [])
        for i, owner in enumerate(leaf.owners):
            if owner < 0 or not mask[i]:
                continue
            key = (owner, leaf.prompt_len + i)
            if key in seen:
                mask[i] = 0
            seen.add(key)
        sample.loss_mask = mask
    return samples


def build_samples(
    session: Session,
    base: Sample,
    pick: PickFn = pick_leaves,
    post: PostFn = mask_exactly_once,
    decode: Any = None,
) -> list[Sample]:
    """The session's training samples: the picker's leaves as copies of `base`, through the post-processor."""
    leaves = pick(session)
    if not isinstance(leaves, list) or not all(isinstance(n, Node) for n in leaves):
        raise ValueError(
            f"the session sample picker returned {type(leaves).__name__}; expected a list of Node"
        )
    samples = [to_sample(leaf, copy.deepcopy(base), decode) for leaf in leaves]
    for sample, leaf in zip(samples, leaves):
        sample.metadata["session_leaf"] = leaf.id
    out = post(samples, leaves)
    if not isinstance(out, list) or not all(isinstance(s, Sample) for s in out):
        raise ValueError(
            f"the session sample postprocessor returned {type(out).__name__}; expected a list of Sample"
        )
    return out
