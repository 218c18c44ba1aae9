"""`LocalEngine`: model, tokenizer, weights and scheduler of the embedded engine, independent of HTTP.

Every operation that touches the model runs on the scheduler thread (through `Scheduler.call`), so weight
updates and memory release never interleave with a forward pass. Methods return futures; the HTTP layer awaits
them with a timeout.
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from miles.engines.local.model_runner import make_runner
from miles.engines.local.sampling import SamplingParams
from miles.engines.local.scheduler import Scheduler
from miles.engines.local.weights import EngineNotReady, WeightStore, unflatten_bucket

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# /generate fields: used, accepted but irrelevant here (routing/metadata), or accepted only at their neutral value
_GEN_USED = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "return_text_in_logprobs"}
_GEN_IGNORED = {
    "log_metrics", "data_parallel_rank", "routed_dp_rank", "priority", "session_id", "routing_key",
    "conversation_id", "custom_labels", "no_logs", "extra_key", "modalities", "background", "received_time",
    "model",  # added by sglang-router when it forwards a request
}  # fmt: skip
_GEN_NEUTRAL: dict[str, Any] = {
    "stream": False, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
    "return_hidden_states": False, "return_routed_experts": False, "return_entropy": False, "lora_path": None,
    "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
    "custom_logit_processor": None, "session_params": None, "return_prompt_token_ids": False,
    "return_bytes": False,  # added by sglang-router
}  # fmt: skip


def _check_generate_fields(body: dict[str, Any]) -> None:
    errors = []
    for key, value in body.items():
        if key in _GEN_USED or key in _GEN_IGNORED:
            continue
        if key not in _GEN_NEUTRAL:
            errors.append(f"unknown field {key!r}")
            continue
        neutral = _GEN_NEUTRAL[key]
        values = value if isinstance(value, list) and key not in ("token_ids_logprob",) else [value]
        if any(v is not None and v != neutral for v in values):
            errors.append(f"{key}={value!r} is not supported by the embedded engine (only {neutral!r})")
    if errors:
        raise ValueError("/generate: " + "; ".join(errors) + f"; supported fields: {sorted(_GEN_USED)}")


@dataclass(frozen=True)
class EngineConfig:
    """Startup options of the embedded engine (the CLI flags of `python -m miles.engines.local`)."""

    model_path: str
    tokenizer_path: str | None = None
    dtype: str = "float32"
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    random_seed: int = 0
    weight_version: str = "default"


def _check_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; allowed: {list(MEMORY_TAGS)} (or null for all)")
    return list(tags)


class LocalEngine:
    """The embedded rollout engine (TP=1, CPU or one device)."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.dtype not in DTYPES:
            raise ValueError(f"--dtype {config.dtype!r} not supported; allowed: {sorted(DTYPES)}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.config = config
        self.model_path = config.model_path
        self.tokenizer_path = config.tokenizer_path or config.model_path
        self.dtype = DTYPES[config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=self.dtype).eval()
        self.weights = WeightStore(self.model)
        self.runner = make_runner(self.model)
        self.weight_version = config.weight_version
        self.kv_released = False
        self.update_groups: dict[str, Any] = {}
        self.scheduler = Scheduler(
            runner_fn=lambda: self.runner,
            tokenizer=self.tokenizer,
            eos_ids=self._eos_ids(),
            check_ready=self._check_ready,
            weight_version_fn=lambda: self.weight_version,
            max_running_requests=config.max_running_requests,
            max_total_tokens=config.max_total_tokens,
            random_seed=config.random_seed,
        )

    def _eos_ids(self) -> set[int]:
        ids = set()
        eos = self.model.config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _check_ready(self) -> None:
        self.weights.check_ready()
        if self.kv_released:
            raise EngineNotReady("KV cache is released; call /resume_memory_occupation first")

    def start(self) -> None:
        """Start the scheduler thread."""
        self.scheduler.start()

    def stop(self) -> None:
        """Stop the scheduler thread, aborting what is in flight."""
        self.scheduler.stop()

    # ------------------------------------------------------------------ generation
    def submit_generate(self, body: dict[str, Any]) -> tuple[list[str], list[Future], bool]:
        """Queue the request(s) of a /generate body; returns (rids, futures, is_batch)."""
        _check_generate_fields(body)
        if ("input_ids" in body) == ("text" in body):
            raise ValueError("/generate needs exactly one of 'input_ids' or 'text'")
        if "input_ids" in body:
            prompts = body["input_ids"]
            is_batch = bool(prompts) and isinstance(prompts[0], list)
            prompts = prompts if is_batch else [prompts]
        else:
            texts = body["text"]
            is_batch = isinstance(texts, list)
            prompts = [self.tokenizer.encode(t) for t in (texts if is_batch else [texts])]
        n = len(prompts)
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * n
        rl = body.get("return_logprob", False)
        rls = rl if isinstance(rl, list) else [rl] * n
        rid = body.get("rid")
        if rid is None:
            base = uuid.uuid4().hex
            rids = [f"{base}-{i}" for i in range(n)] if is_batch else [base]
        else:
            rids = rid if isinstance(rid, list) else ([f"{rid}-{i}" for i in range(n)] if is_batch else [rid])
        if not (len(sps) == len(rls) == len(rids) == n):
            raise ValueError(
                f"batch sizes differ: {n} prompts, {len(sps)} sampling_params, {len(rls)} return_logprob, "
                f"{len(rids)} rids"
            )
        for ids in prompts:
            if not all(isinstance(t, int) and 0 <= t < self.model.config.vocab_size for t in ids):
                raise ValueError(
                    f"input_ids must be ints in [0, {self.model.config.vocab_size}), got {ids[:8]}..."
                )
        rids = [str(r) for r in rids]
        if len(set(rids)) != n:
            raise ValueError(f"rids within one request must be unique, got {rids}")
        params = [SamplingParams.from_dict(s) for s in sps]
        with_text = bool(body.get("return_text_in_logprobs", False))
        futures: list[Future] = []
        try:
            for r, ids, p, lp in zip(rids, prompts, params, rls):
                futures.append(self.scheduler.submit(r, ids, p, bool(lp), with_text))
        except Exception:
            for r in rids[: len(futures)]:  # all or nothing: withdraw the part of the batch already queued
                self.run("abort", rid=r)
            raise
        return rids, futures, is_batch

    # ------------------------------------------------------------------ admin (run on the scheduler thread)
    def run(self, fn_name: str, **kwargs: Any) -> Future:
        """Run admin operation `_op_<fn_name>(**kwargs)` on the scheduler thread."""
        fn = getattr(self, f"_op_{fn_name}")
        return self.scheduler.call(lambda: fn(**kwargs))

    def _op_abort(self, rid: str = "", abort_all: bool = False) -> dict[str, Any]:
        n = self.scheduler.abort(rid=rid or None, abort_all=abort_all)
        return {"success": True, "message": f"aborted {n} request(s)"}

    def _op_pause(self, mode: str = "abort") -> dict[str, Any]:
        self.scheduler.set_paused(mode)
        return {"success": True, "message": f"generation paused (mode={mode})"}

    def _op_continue(self) -> dict[str, Any]:
        self.scheduler.set_paused(None)
        return {"success": True, "message": "generation continued"}

    def _op_flush_cache(self) -> dict[str, Any]:
        # KV caches are per request and freed when it finishes; there is no shared prefix cache to drop.
        return {"success": True, "message": "cache flushed (no prefix cache is kept)"}

    def _set_version(self, weight_version: str | None) -> None:
        if weight_version is not None:
            self.weight_version = str(weight_version)

    def _op_update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        from miles.utils.serialization import deserialize

        if load_format not in (None, "direct", "flattened_bucket"):
            raise ValueError(
                f"load_format {load_format!r} not supported; allowed: null (named tensors), 'flattened_bucket'"
            )
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise ValueError(
                "serialized_named_tensors must be a non-empty list (one base64 string per TP rank)"
            )
        named = deserialize(serialized_named_tensors[0])
        if load_format == "flattened_bucket":
            named = unflatten_bucket(named)
        if abort_all_requests:
            self.scheduler.abort(abort_all=True, message="aborted for weight update")
        n = self.weights.load(named)
        self._set_version(weight_version)
        return {"success": True, "message": f"updated {n} tensors"}

    def _op_update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        if load_format not in (None, "auto"):
            raise ValueError(f"load_format {load_format!r} not supported; allowed: null, 'auto'")
        fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        named = dict(fresh.named_parameters())
        missing = set(self.weights.names) - {self.weights.resolve(n) for n in named}
        if missing:
            raise ValueError(f"{model_path!r} lacks parameters {sorted(missing)[:5]} of the served model")
        self.weights.load(named.items())
        self.model_path = model_path
        self._set_version(weight_version)
        return {"success": True, "message": f"loaded {len(named)} tensors from {model_path}"}

    def _op_release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        tags = _check_tags(tags)
        n = self.scheduler.abort(abort_all=True, message="aborted by release_memory_occupation")
        if "weights" in tags:
            self.weights.release()
        if "kv_cache" in tags:
            self.kv_released = True  # every request's cache is dropped with the aborted requests
        return {"success": True, "message": f"released {tags}; aborted {n} request(s)"}

    def _op_resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        tags = _check_tags(tags)
        if "weights" in tags:
            self.weights.resume()
        if "kv_cache" in tags:
            self.kv_released = False
        return {"success": True, "message": f"resumed {tags}"}

    def _op_get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return self.weights.get(name).flatten()[:truncate_size].float().tolist()

    def _op_init_weights_update_group(self, **kwargs: Any) -> dict[str, Any]:
        from miles.engines.local.dist_update import init_update_group

        name = kwargs.get("group_name", "weight_update_group")
        if name in self.update_groups:
            raise ValueError(f"weights update group {name!r} already exists")
        self.update_groups[name] = init_update_group(**kwargs)
        return {"success": True, "message": f"joined weights update group {name!r}"}

    def _op_update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        from miles.engines.local.dist_update import receive_tensors

        if group_name not in self.update_groups:
            raise ValueError(f"no weights update group {group_name!r}; known: {sorted(self.update_groups)}")
        if self.weights.released:
            raise ValueError(
                "cannot load weights while they are released; call /resume_memory_occupation first"
            )
        if abort_all_requests:
            self.scheduler.abort(abort_all=True, message="aborted for weight update")
        n = receive_tensors(self.update_groups[group_name], names, dtypes, shapes, self.weights)
        self._set_version(weight_version)
        return {"success": True, "message": f"updated {n} tensors"}

    def _op_destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        from miles.engines.local.dist_update import destroy_update_group

        if group_name not in self.update_groups:
            raise ValueError(f"no weights update group {group_name!r}; known: {sorted(self.update_groups)}")
        destroy_update_group(self.update_groups.pop(group_name))
        return {"success": True, "message": f"destroyed weights update group {group_name!r}"}

    # ------------------------------------------------------------------ info
    def model_info(self) -> dict[str, Any]:
        """Body of GET /get_model_info."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.model.config.model_type,
            "architectures": getattr(self.model.config, "architectures", None),
        }

    def server_info(self, host: str, port: int) -> dict[str, Any]:
        """Body of GET /get_server_info: the startup options plus live state."""
        stats = dict(self.scheduler.stats)
        secs = stats["decode_seconds"]
        stats["decode_tokens_per_s"] = stats["decode_tokens"] / secs if secs > 0 else 0.0
        return {
            "engine": "miles-local",
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "host": host,
            "port": port,
            "tp_size": 1,
            "dp_size": 1,
            "dtype": self.config.dtype,
            "max_running_requests": self.config.max_running_requests,
            "max_total_num_tokens": self.config.max_total_tokens,
            "random_seed": self.config.random_seed,
            "kv_cache": "per-request" if self.runner.uses_kv_cache else "none (full forward per step)",
            "weight_version": self.weight_version,
            "paused": self.scheduler.paused,
            "weights_released": self.weights.released,
            "kv_cache_released": self.kv_released,
            "pending_weight_tensors": len(self.weights.pending),
            "internal_states": [{**stats, **self.scheduler.load()}],
            "version": "miles-local-0.1",
        }
