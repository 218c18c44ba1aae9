"""Weight-update and memory operations of the embedded engine, under SGLang 0.5.23's contract.

The rules and the refusal wording are SGLang's (see docs/sglang-contract.md for the table and the source files):

- refit (`update_weights_from_tensor`, `update_weights_from_distributed`) only inside a session opened by
  `begin_weight_update` and closed by `end_weight_update`; a second `begin` while one is open is refused
  (sglang/srt/managers/scheduler_components/weight_updater.py);
- a weight update with `flush_cache` (the default) while requests run (an `in_place` pause) loads the weights but
  answers success=false, as SGLang's `flush_cache_after_weight_update` does;
- `release_memory_occupation` only when no request runs or waits (queued requests are allowed while paused), and
  `flush_cache` likewise (400 otherwise, so a release can wait for idle by retrying it);
  released tags are remembered, and `resume_memory_occupation` of a tag that was not released is an error (SGLang's
  scheduler dies there with a KeyError; the stand-in answers 400 instead of dying);
- `weights_checker` with action `checksum` answers SGLang's payload: per tensor 16 hex digits of the hash SGLang
  uses for the device it is on (SHA-256 on CPU, the tile hash on CUDA; `miles.utils.weight_checksum`), one rank.

`LocalEngine` mixes this in; every `_op_*` runs on the scheduler thread (through `LocalEngine.run` and its
table `LocalEngine.admin_ops`), except `join_update_group`, which waits for remote peers and so runs on a thread of its own with a short deadline.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import TYPE_CHECKING, NotRequired, TypedDict

import torch

from miles.refit.moe_names import split_stacked
from miles.refit.vl_names import engine_name
from miles.utils import host_memory
from miles.utils.types import JSON
from miles.utils.weight_checksum import device_hash_kind, overall_checksum, tensor_checksum

if TYPE_CHECKING:
    import torch.distributed as dist

    from miles.engines.local.dist_update import GroupRequest
    from miles.engines.local.engine import LocalEngineConfig
    from miles.engines.local.engine_loop import EngineLoop
    from miles.engines.local.model_runner import NoCacheRunner, PoolRunner
    from miles.engines.local.weights import WeightStore
    from miles.refit.window_layout import MappedWindow, WindowLayout


def missing_local_path(model_path: str) -> str | None:
    """Why `model_path` names a local directory that is not there, or None. A path that cannot be a Hub repo id
    (absolute, starting with '.' or '~', or with more than one '/') and does not exist would otherwise reach
    `from_pretrained` as a repo id and fail with the Hub's "Repo id must be in the form ..." error."""
    if os.path.exists(model_path):
        return None
    if os.path.isabs(model_path) or model_path.startswith((".", "~")) or model_path.count("/") > 1:
        return f"model_path {model_path!r}: the path does not exist"
    return None


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
NOT_IN_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"


class Reply(TypedDict):
    """The body of a successful admin operation, as SGLang answers it."""

    success: bool
    message: str


class WindowRefitReply(Reply):
    weight_version: str  # the version now served
    ranks: NotRequired[list[RankChecksums]]  # asked with `checksums`: as /weights_checker answers them
    per_engine_checksum: NotRequired[str]
    checksum_seconds: NotRequired[float]  # the engine's time computing them


class LayoutReply(Reply):
    layout: dict[str, JSON]  # WindowLayout.to_json()


class DiskReply(Reply):
    num_paused_requests: int


class RankChecksums(TypedDict):
    """One rank's part of a `weights_checker` answer (sglang/srt/utils/weight_checker.py)."""

    checksums: dict[str, str]  # parameter name -> 16 hex digits
    per_gpu_checksum: str
    parallelism_info: list[dict[str, str | int]]  # one per model role (SGLang: target, draft...)


class ChecksumReply(Reply):
    ranks: list[RankChecksums]
    per_engine_checksum: str


class RefitRefused(ValueError):
    """A contract violation SGLang answers with success=false (HTTP 400)."""


def check_tags(tags: list[str] | None) -> list[str]:
    """The tags of a release/resume request; None or [] means all (as in SGLang)."""
    if not tags:
        return list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; allowed: {list(MEMORY_TAGS)} (or null for all)")
    return list(tags)


class WeightControl:
    """Mixin of `LocalEngine`: the session, release/resume bookkeeping, refit and checksum operations."""

    # provided by LocalEngine
    weights: WeightStore
    scheduler: EngineLoop
    runner: PoolRunner | NoCacheRunner
    kv_released: bool
    released_tags: set[str]
    session_open: bool
    update_groups: dict[str, dist.ProcessGroup | None]  # None: reserved while joining
    config: LocalEngineConfig
    dtype: torch.dtype
    model_path: str
    weight_version: str
    _groups_lock: threading.Lock
    _window_plan: WindowLayout | None  # planned on first use
    _window: MappedWindow | None  # the window of the last window refit

    def _set_version(self, weight_version: str | None) -> None:
        raise NotImplementedError

    def _require_session(self, op: str) -> None:
        if not self.session_open:
            raise RefitRefused(NOT_IN_SESSION.format(op=op))

    def _op_begin_weight_update(self, selector: str = "all") -> Reply:
        if selector not in ("target", "draft", "all"):
            raise ValueError(f"selector {selector!r} not supported; allowed: 'target', 'draft', 'all'")
        if self.session_open:
            raise RefitRefused("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return {"success": True, "message": "Success"}

    def _op_end_weight_update(self) -> Reply:
        if not self.session_open:
            raise RefitRefused("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return {"success": True, "message": "Success"}

    def _op_update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        selector: str = "all",
        torch_empty_cache: bool = False,
    ) -> Reply:
        from miles.engines.local.weights import unflatten_bucket
        from miles.utils.serialization import PayloadError, deserialize

        self._require_session("update_weights_from_tensor")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise ValueError(
                f"load_format {load_format!r} not supported; allowed: null (named tensors), 'flattened_bucket'"
            )
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise ValueError(
                "serialized_named_tensors must be a non-empty list (one base64 string per TP rank)"
            )
        try:
            named = deserialize(serialized_named_tensors[0])
        except PayloadError as e:
            raise ValueError(f"serialized_named_tensors[0] does not decode: {e}") from None
        if load_format == "flattened_bucket":
            named = unflatten_bucket(named)
        elif not isinstance(named, list) or not all(isinstance(x, tuple) and len(x) == 2 for x in named):
            raise ValueError(
                f"serialized_named_tensors[0] must hold a list of (name, tensor) pairs, got {type(named).__name__}"
            )
        if abort_all_requests:
            self.scheduler.abort(abort_all=True, message="aborted for weight update")
        n = self.weights.load(named)
        self._set_version(weight_version)
        self._flush_after_update(flush_cache)
        return {"success": True, "message": f"Success. Updated {n} tensors."}

    def _op_update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        selector: str = "all",
        torch_empty_cache: bool = False,
    ) -> Reply:
        from miles.engines.local.dist_update import receive_tensors

        self._require_session("update_weights_from_distributed")
        if load_format is not None:
            raise ValueError(
                f"load_format {load_format!r} not supported on the broadcast path; allowed: null"
            )
        group = self.update_groups.get(group_name)
        if group is None:
            raise ValueError(f"no weights update group {group_name!r}; known: {sorted(self.update_groups)}")
        if self.weights.released:
            raise ValueError(
                "cannot load weights while they are released; call /resume_memory_occupation first"
            )
        if abort_all_requests:
            self.scheduler.abort(abort_all=True, message="aborted for weight update")
        n = receive_tensors(group, names, dtypes, shapes, self.weights)
        self._set_version(weight_version)
        self._flush_after_update(flush_cache)
        return {"success": True, "message": f"Succeeded to update parameter online ({n} tensors)."}

    def _window_layout(self) -> WindowLayout:
        from miles.engines.local.window import plan_layout

        if self._window_plan is None:
            store = self.weights
            shapes = {n: store.shape_dtype(n)[0] for n in store.names}
            fused = [g for layer in getattr(self.runner, "layers", []) for g in layer.projections()]
            aliases = {a: store.resolve(a) for a in store.aliases}
            self._window_plan = plan_layout(store.params, shapes, aliases, fused, self.dtype)
        return self._window_plan

    def _op_weight_window_layout(self) -> LayoutReply:
        """miles-only: where each parameter lives in a weight window (see miles.engines.local.window)."""
        return {"success": True, "message": "Success", "layout": self._window_layout().to_json()}

    def _op_update_weights_from_window(
        self,
        path: str,
        layout_digest: str,
        flush_cache: bool = True,
        weight_version: str | None = None,
        resume_tags: list[str] | None = None,
        checksums: bool = False,
    ) -> WindowRefitReply:
        """miles-only: a whole refit in one call, its own weight-update session (refused while another is open):
        point every parameter at its view of the trainer's window file (no copy) and serve `weight_version`.
        `resume_tags`: resumed first (as `/resume_memory_occupation`; nothing to fill once the weights are window
        views); `checksums`: the answer carries `/weights_checker`'s `ranks` and `per_engine_checksum` too. Each
        saves the trainer a round trip per refit."""
        from miles.refit.window_layout import MappedWindow

        if self.session_open:
            raise RefitRefused(
                "update_weights_from_window is a weight-update session of its own; call end_weight_update() first"
            )
        layout = self._window_layout()
        if layout_digest != layout.digest():
            raise ValueError(
                f"window layout digest {layout_digest!r} differs from this engine's {layout.digest()!r} "
                "(the trainer wrote another model's or dtype's layout; ask /weight_window_layout again)"
            )
        if resume_tags is not None:
            self._op_resume_memory_occupation(resume_tags)
        if self._window is None or self._window.path != path:
            self._window = MappedWindow(path, layout)  # first refit, a new window, or a restarted engine
        n = self.weights.point_at(self._window.views)
        self._set_version(weight_version)
        self._flush_after_update(flush_cache)
        served = self.weight_version
        reply: WindowRefitReply = {
            "success": True,
            "message": f"Success. Updated {n} tensors.",
            "weight_version": served,
        }
        if checksums:
            start = time.perf_counter()
            checked = self._op_weights_checker()
            reply["ranks"] = checked["ranks"]
            reply["per_engine_checksum"] = checked["per_engine_checksum"]
            reply["checksum_seconds"] = time.perf_counter() - start
        return reply

    def _op_update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> DiskReply:
        from transformers import AutoModelForCausalLM

        if load_format not in (None, "auto"):
            raise ValueError(f"load_format {load_format!r} not supported; allowed: null, 'auto'")
        problem = missing_local_path(model_path)
        if problem:
            raise ValueError(problem)
        fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        named = dict(fresh.named_parameters())
        missing = set(self.weights.names) - {self.weights.resolve(n) for n in named}
        if missing:
            raise ValueError(f"{model_path!r} lacks parameters {sorted(missing)[:5]} of the served model")
        self.weights.load(named.items())
        self.model_path = model_path
        self._set_version(weight_version)
        self._flush_after_update(flush_cache)
        return {
            "success": True,
            "message": f"loaded {len(named)} tensors from {model_path}",
            "num_paused_requests": 0,
        }

    def _pending_requests(self) -> str | None:
        """Why the engine is not idle as SGLang's scheduler counts it (`is_fully_idle`: no request runs, none
        waits unless generation is paused), in the words of its flush_cache warning; None when idle."""
        load = self.scheduler.load()
        if load["num_running"] or (load["num_waiting"] and not self.scheduler.paused):
            return f"#queue-req: {load['num_waiting']}, #running-req: {load['num_running']}"
        return None

    def _flush_after_update(self, flush_cache: bool) -> None:
        """SGLang flushes the cache after a weight update when asked (the default) and, when requests still run
        (an in_place pause) or wait (not paused), fails the update call although the weights were loaded and the
        version set: a refit under an in_place pause must send flush_cache=false."""
        if flush_cache and self._pending_requests() is not None:
            raise RefitRefused(
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache."
            )

    def _op_flush_cache(self) -> Reply:
        # SGLang flushes only when idle and answers 400 otherwise: a release waits on this (EngineMemoryControl).
        # A finished request's pool slot is reused by the next one; there is no shared prefix cache to drop.
        pending = self._pending_requests()
        if pending is not None:
            raise RefitRefused(f"Cache not flushed because there are pending requests. {pending}")
        return {"success": True, "message": "cache flushed (no prefix cache is kept)"}

    def _op_release_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = check_tags(tags)
        if self._pending_requests() is not None:
            # SGLang's scheduler asserts this (weight_updater.py) and dies; the stand-in refuses with its words
            raise RefitRefused("release_memory_occupation should be called only when server is idle.")
        if "weights" in tags:
            self.weights.release()
        if "kv_cache" in tags:
            self.runner.release_kv()  # the pool's storage is freed, not just marked unused
            self.kv_released = True
        self.released_tags.update(tags)
        if self.config.trim_after_release:
            host_memory.trim()  # what was freed leaves the process too (malloc keeps it otherwise)
        return None  # SGLang answers 200 with an empty (null) body

    def _op_resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = check_tags(tags)
        not_released = [t for t in tags if t not in self.released_tags]
        if not_released:
            raise RefitRefused(
                f"resume_memory_occupation: tags {not_released} were not released (released: "
                f"{sorted(self.released_tags)}); SGLang's scheduler dies here with KeyError: {not_released[0]!r}"
            )
        self.released_tags.difference_update(tags)
        if "weights" in tags:
            # after a window refit the next one points the weights at views again: nothing to fill
            self.weights.resume(allocate=self._window is None)
        if "kv_cache" in tags:
            self.runner.resume_kv()
            self.kv_released = False
        return None

    def _op_get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return self.weights.get(name).flatten()[:truncate_size].float().tolist()

    def _op_weights_checker(
        self,
        action: str = "checksum",
        allow_quant_error: bool = False,
        skip_tensor_list: list[str] | None = None,
        selector: str = "all",
    ) -> ChecksumReply:
        if action != "checksum":
            raise ValueError(f"weights_checker action {action!r} not supported here; allowed: 'checksum'")
        self.weights.check_ready()
        skip = skip_tensor_list or []
        checksums: dict[str, str] = {}
        for name in self.weights.names:  # a weight loaded from FP8: the checksums of what arrived
            if any(pattern in name for pattern in skip):
                continue
            sent = self.weights.fp8_checksums.get(name)
            if sent:
                checksums.update(sent)
            else:
                # under the names a refit sends (a VL model's: vl_names; stacked experts per expert: moe_names)
                t = self.weights.get(name)
                for sent_name, part in split_stacked(engine_name(name), t):
                    checksums[sent_name] = tensor_checksum(part, device_hash_kind(t.device))
        overall = overall_checksum(checksums)
        rank: RankChecksums = {
            "checksums": checksums,
            "per_gpu_checksum": overall,
            "parallelism_info": [
                {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                 "pp_size": 1, "rank": 0, "size": 1}
            ],
        }  # fmt: skip
        engine = hashlib.sha256(overall.encode()).hexdigest()
        return {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine}

    def join_update_group(self, request: GroupRequest) -> Reply:
        """Body of /init_weights_update_group; blocks only the calling thread, at most the group timeout."""
        from miles.engines.local.dist_update import init_update_group

        name = request.group_name
        with self._groups_lock:
            if name in self.update_groups:
                raise ValueError(f"weights update group {name!r} already exists")
            self.update_groups[name] = None  # reserved while joining
        try:
            group = init_update_group(request, timeout_s=self.config.update_group_timeout)
        except BaseException:
            with self._groups_lock:
                self.update_groups.pop(name, None)
            raise
        with self._groups_lock:
            self.update_groups[name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _op_destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Reply:
        from miles.engines.local.dist_update import destroy_update_group

        group = self.update_groups.get(group_name)
        if group is None:
            raise RefitRefused("The group to be destroyed does not exist.")
        del self.update_groups[group_name]
        destroy_update_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}
