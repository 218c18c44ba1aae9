"""Refit colocated engines (on the same devices as the training ranks) through tensor handles, bucket by bucket.

Engine ``e`` is served by training ranks ``e * ranks_per_engine ... (e + 1) * ranks_per_engine - 1`` (one per
engine TP rank). For every bucket (`miles.refit.buckets.stream_buckets`) each of those ranks turns its gathered
tensors into a tensor-handle string (CUDA IPC / shared memory, see `miles.utils.serialization`), the engine's
leader rank collects the strings in TP order and POSTs them to ``/update_weights_from_tensor``. All ranks then
agree on success before the next bucket, which also keeps every rank's tensors alive until the engine has
answered. The session around it: `miles.refit.session`.
"""

from __future__ import annotations

import torch.distributed as dist

from miles.refit.buckets import Bucket, RefitJob, stream_buckets
from miles.refit.engine_endpoints import begin_sessions, end_sessions, verify_refit
from miles.refit.session import RefitSetup, WeightUpdater
from miles.utils.engine_control_http import post_engine
from miles.utils.serialization import serialize, share_named_tensors


class ColocatedWeightUpdater(WeightUpdater):
    """Refit colocated engines through tensor handles, bucket by bucket (see the module docstring)."""

    def __init__(self, setup: RefitSetup) -> None:
        n_engines, per_engine = len(setup.engine_urls), setup.ranks_per_engine
        max_engines = setup.world_size // per_engine
        if n_engines > max_engines:
            raise ValueError(
                f"{n_engines} colocated engines need {n_engines * per_engine} training ranks "
                f"({per_engine} per engine), but world_size={setup.world_size}: at most {max_engines} engines"
            )
        super().__init__(setup)
        self._engine_groups = [
            dist.new_group(self.global_ranks[e * per_engine : (e + 1) * per_engine], backend="gloo")
            for e in range(n_engines)
        ]
        e = self.rank // per_engine
        self.engine_index: int | None = e if e < n_engines else None
        self.is_leader = self.engine_index is not None and self.rank % per_engine == 0

    def url_if_targeted(self, targets: list[str]) -> str | None:
        """Our engine's URL when this rank serves it and it is one of ``targets``, else None."""
        if self.engine_index is None or self.engine_urls[self.engine_index] not in targets:
            return None
        return self.engine_urls[self.engine_index]

    def push(self, job: RefitJob, targets: list[str]) -> int:
        version = job.weight_version
        targeted = self.url_if_targeted(targets)
        url = targeted if self.is_leader else None
        self.run_agreed(
            self.is_leader, lambda: url and begin_sessions([url], self.headers, self.timeout_s, version)
        )
        checksums = self.new_checksums(job, self.is_leader)

        def send(bucket: Bucket, index: int, is_last: bool) -> None:
            flush = is_last and job.flush_cache
            self.run_agreed(targeted is not None, lambda: self._send_bucket(bucket, index, flush, version))

        try:
            n_buckets = stream_buckets(job, checksums, send)
        finally:
            self.run_agreed(
                self.is_leader, lambda: url and end_sessions([url], self.headers, self.timeout_s, version)
            )

        def verify() -> None:
            if url:
                verify_refit([url], version, self.headers, self.timeout_s, checksums)

        self.run_agreed(self.is_leader, verify)
        return n_buckets

    def _send_bucket(self, bucket: Bucket, index: int, flush: bool, weight_version: str) -> None:
        if self.engine_index is None:
            return
        payload = serialize(share_named_tensors(bucket))
        group = self._engine_groups[self.engine_index]
        leader = self.global_ranks[self.engine_index * self.ranks_per_engine]
        gathered: list[str | None] | None = [None] * self.ranks_per_engine if self.is_leader else None
        dist.gather_object(payload, gathered, dst=leader, group=group)
        if gathered is not None:  # the leader: every rank's payload, in TP order
            self._post(self.engine_urls[self.engine_index], index, gathered, flush, weight_version)

    def _post(
        self, url: str, index: int, payloads: list[str | None], flush: bool, weight_version: str
    ) -> None:
        body = {
            "serialized_named_tensors": payloads,
            "load_format": None,
            "flush_cache": flush,
            "weight_version": weight_version,
        }
        post_engine(
            url,
            "update_weights_from_tensor",
            body,
            self.headers,
            self.timeout_s,
            f"refit {weight_version}, bucket {index}",
        )
