"""`LocalEngine`: model, tokenizer, weights and scheduler of the embedded engine, independent of HTTP.

Every operation that touches the model runs on the scheduler thread (through `Scheduler.call`), so weight
updates and memory release never interleave with a forward pass. Methods return futures; the HTTP layer awaits
them with a timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from miles.engines.local.control import RefitRefused, Reply, WeightControl
from miles.engines.local.engine_loop import EngineLoop
from miles.engines.local.lora import LoraAdapters
from miles.engines.local.model_runner import NoCacheRunner, PoolRunner, make_runner
from miles.engines.local.output import GenerateAnswer
from miles.engines.local.routing_capture import routing_runner
from miles.engines.local.sampling import SamplingParams
from miles.engines.local.vl_runner import VLRunner, load_model, prepare_images
from miles.engines.local.weights import EngineNotReady, WeightStore
from miles.utils.types import JSON

if TYPE_CHECKING:
    import torch.distributed as dist
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /generate fields: used, accepted but irrelevant here (routing/metadata), or accepted only at their neutral value
_GEN_USED = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "return_text_in_logprobs",
    "lora_path",
    "image_data",  # VL models only (vl_runner)
    "return_routed_experts",  # answered only with --enable-return-routed-experts, as SGLang (routing_capture.py)
}
_GEN_IGNORED = {
    "log_metrics", "data_parallel_rank", "routed_dp_rank", "priority", "session_id", "routing_key",
    "conversation_id", "custom_labels", "no_logs", "extra_key", "modalities", "background", "received_time",
    "model",  # added by sglang-router when it forwards a request
}  # fmt: skip
_GEN_NEUTRAL: dict[str, JSON] = {
    "stream": False, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
    "return_hidden_states": False, "routed_experts_start_len": 0, "return_entropy": False,
    "video_data": None, "audio_data": None, "input_embeds": None,
    "custom_logit_processor": None, "session_params": None, "return_prompt_token_ids": False,
    "return_bytes": False,  # added by sglang-router
}  # fmt: skip


def _check_generate_fields(body: dict[str, JSON]) -> None:
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


class LoraReply(TypedDict):
    """SGLang's `LoRAUpdateOutput`: the answer of /load_lora_adapter and /unload_lora_adapter."""

    success: bool
    error_message: str | None
    loaded_adapters: dict[str, str]  # name -> path


def _lora_paths(given: JSON, n: int) -> list[str | None]:
    """A /generate body's `lora_path` per prompt: one name (or null) for all, or a list of n."""
    if given is None or isinstance(given, str):
        return [given] * n
    if isinstance(given, list) and len(given) == n and all(g is None or isinstance(g, str) for g in given):
        return [g if isinstance(g, str) else None for g in given]
    raise ValueError(f"lora_path must be a LoRA adapter name, null, or a list of {n} of them; got {given!r}")


def _device(name: str) -> torch.device:
    """`--device` as a torch device; a CUDA device must be visible."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(
            f"--device {name!r} is not a torch device ({e}); allowed: cpu, cuda, cuda:N"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: allowed cpu, cuda, cuda:N")
    if device.type == "cuda" and (
        not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
    ):
        raise ValueError(f"--device {name}: no such CUDA device ({torch.cuda.device_count()} visible)")
    return device


def _token_ids(ids: JSON, vocab_size: int) -> list[int]:
    """One prompt's `input_ids`, checked: ints in [0, vocab_size)."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        shown = ids[:8] if isinstance(ids, list) else ids
        raise ValueError(f"input_ids must be ints in [0, {vocab_size}), got {shown}...")
    return [t for t in ids if isinstance(t, int)]


class PauseReply(TypedDict):
    """SGLang's body of /pause_generation and /continue_generation (no `success` field)."""

    message: str
    status: str


class ModelInfo(TypedDict):
    """Body of GET /get_model_info (SGLang's fields)."""

    model_path: str
    tokenizer_path: str
    is_generation: bool
    preferred_sampling_params: None
    weight_version: str
    has_image_understanding: bool
    has_audio_understanding: bool
    model_type: str
    architectures: list[str] | None


@dataclass(frozen=True)
class LocalEngineConfig:
    """Startup options of the embedded engine (the CLI flags of `python -m miles.engines.local`)."""

    model_path: str
    tokenizer_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"  # where the model lives: cpu, cuda, cuda:N
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    context_length: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill_size: int | None = 8192  # prompt tokens per forward; None: unlimited
    random_seed: int = 0
    weight_version: str = "default"
    update_group_timeout: float = 30.0  # seconds /init_weights_update_group may wait for its peers
    # CPU, float32: large projections multiply by oneDNN-packed copies of the weights (faster; one more copy of
    # them in memory while they are loaded), see model_runner.py
    cpu_packed_weights: bool = True
    # CPU, float32: decode attention by a C kernel compiled on first use (see cpu_attention.py); the matmul path
    # when off, or when no compiler is found (logged)
    cpu_decode_kernel: bool = True
    trim_after_release: bool = (
        True  # malloc_trim after a memory release (off inside a training rank's process)
    )
    enable_return_routed_experts: bool = False  # SGLang's flag: MoE routing per token (routing_capture.py)
    test_off_top_k_every: int = 0  # test aid: route positions 0, N, 2N.. off the top-k (routing_capture.py)
    # read no weights: start with them released (as after /release_memory_occupation of "weights"); a resume
    # and a refit bring them (a colocated engine in a training rank: the start-up refit sends the rank's own)
    start_released: bool = False


def _context_length(requested: int | None, model_config: PretrainedConfig) -> int:
    """--context-length, or the model's max_position_embeddings; longer than the model's is refused."""
    derived = int(model_config.max_position_embeddings)
    if requested is None:
        return derived
    if not 2 <= requested <= derived:
        raise ValueError(
            f"--context-length {requested} must be in [2, {derived}] (the model's max_position_embeddings)"
        )
    return requested


class LocalEngine(WeightControl):
    """The embedded rollout engine (TP=1, CPU or one device)."""

    def __init__(self, config: LocalEngineConfig):
        from transformers import AutoTokenizer

        if config.dtype not in DTYPES:
            raise ValueError(f"--dtype {config.dtype!r} not supported; allowed: {sorted(DTYPES)}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.config = config
        self.model_path = config.model_path
        self.tokenizer_path = config.tokenizer_path or config.model_path
        self.dtype = DTYPES[config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.device = _device(config.device)
        # vl: a VL model's image processing
        model, self.vl = load_model(config.model_path, self.dtype, weights=not config.start_released)
        self.model = model.to(self.device).eval()
        self.weights = WeightStore(self.model)
        self.context_len = _context_length(config.context_length, self.model.config.get_text_config())
        kv_capacity = min(self.context_len, config.max_total_tokens or self.context_len)
        self.runner: PoolRunner | NoCacheRunner = (
            VLRunner(self.model)
            if self.vl
            else make_runner(
                self.model,
                config.max_running_requests,
                kv_capacity,
                self.weights if config.cpu_packed_weights else None,
                decode_kernel=config.cpu_decode_kernel,
            )
        )
        if isinstance(self.runner, PoolRunner):  # its projections keep views of the weights between forwards
            self.weights.on_change(self.runner.forget_views)
        record, off_every = config.enable_return_routed_experts, config.test_off_top_k_every
        self.runner = routing_runner(self.runner, self.model, record, off_every) or self.runner
        self.weight_version = config.weight_version
        self.kv_released = False
        self.released_tags: set[str] = set()  # SGLang's `offload_tags`: filled by release, emptied by resume
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        self.update_groups: dict[str, dist.ProcessGroup | None] = {}
        self._groups_lock = threading.Lock()
        self._window_plan = None
        self._window = None
        self.adapters = LoraAdapters(self.model, self.dtype, self.device)  # /load_lora_adapter (lora.py)
        if isinstance(self.runner, PoolRunner):
            self.runner.adapters = self.adapters
        # `scheduler` is the loop thread around the pure scheduler (`self.scheduler.core`)
        self.scheduler = EngineLoop(
            runner=self.runner,
            tokenizer=self.tokenizer,
            eos_ids=self._eos_ids(),
            check_ready=self._check_ready,
            weight_version_fn=lambda: self.weight_version,
            max_running_requests=config.max_running_requests,
            context_length=self.context_len,
            max_total_tokens=config.max_total_tokens,
            chunked_prefill_size=config.chunked_prefill_size,
            random_seed=config.random_seed,
        )
        if config.start_released:  # nothing was read; generation is refused until a refit loads every tensor
            self.weights.release(unloaded=True)
            self.released_tags.add("weights")

    def _eos_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.model.config.get_text_config(), "eos_token_id", None)
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
    def submit_generate(self, body: dict[str, JSON]) -> tuple[list[str], list[Future[GenerateAnswer]], bool]:
        """Queue the request(s) of a /generate body; returns (rids, futures, is_batch)."""
        _check_generate_fields(body)
        if ("input_ids" in body) == ("text" in body):
            raise ValueError("/generate needs exactly one of 'input_ids' or 'text'")
        prompts: list[JSON]
        if "input_ids" in body:
            given = body["input_ids"]
            if not isinstance(given, list):
                raise ValueError(f"input_ids must be a list of token ids or of lists of them, got {given!r}")
            is_batch = bool(given) and isinstance(given[0], list)
            prompts = given if is_batch else [given]
        else:
            texts = body["text"]
            is_batch = isinstance(texts, list)
            prompts = [self.tokenizer.encode(t) for t in (texts if isinstance(texts, list) else [texts])]
        n = len(prompts)
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * n
        rl = body.get("return_logprob", False)
        rls = rl if isinstance(rl, list) else [rl] * n
        rid = body.get("rid")
        given_rids: list[JSON]
        if rid is None:
            base = uuid.uuid4().hex
            given_rids = [f"{base}-{i}" for i in range(n)] if is_batch else [base]
        else:
            given_rids = (
                rid if isinstance(rid, list) else ([f"{rid}-{i}" for i in range(n)] if is_batch else [rid])
            )
        if not (len(sps) == len(rls) == len(given_rids) == n):
            raise ValueError(
                f"batch sizes differ: {n} prompts, {len(sps)} sampling_params, {len(rls)} return_logprob, "
                f"{len(given_rids)} rids"
            )
        token_ids = [_token_ids(ids, self.model.config.get_text_config().vocab_size) for ids in prompts]
        mms = self._images(body.get("image_data"), token_ids, is_batch)
        rids = [str(r) for r in given_rids]
        if len(set(rids)) != n:
            raise ValueError(f"rids within one request must be unique, got {rids}")
        params = [SamplingParams.from_dict(s) for s in sps]
        for ids, p in zip(token_ids, params):
            self._check_context(len(ids), p.max_new_tokens)
        with_text = bool(body.get("return_text_in_logprobs", False))
        loras = _lora_paths(body.get("lora_path"), n)
        routed = body.get("return_routed_experts", False)
        if not isinstance(routed, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {routed!r}")
        routed = (
            routed and self.config.enable_return_routed_experts
        )  # SGLang: no routed_experts without the flag
        self.adapters.check(loras)
        futures: list[Future[GenerateAnswer]] = []
        try:
            for r, ids, p, lp, lora, mm in zip(rids, token_ids, params, rls, loras, mms):
                futures.append(self.scheduler.submit(r, ids, p, bool(lp), with_text, lora, mm, routed))
        except Exception:
            for r in rids[: len(futures)]:  # all or nothing: withdraw the part of the batch already queued
                self.run("abort", rid=r)
            raise
        return rids, futures, is_batch

    def _images(self, image_data: JSON, token_ids: list[list[int]], is_batch: bool) -> list[object]:
        """Each prompt's processed images (None without); expands `token_ids` in place (one pad per image in,
        the image's token count out), as SGLang's processor does with `image_data`."""
        if image_data is None or image_data == []:
            per_prompt: list[JSON] = [None] * len(token_ids)
        elif self.vl is None:
            raise ValueError("image_data is not supported by the embedded engine for a text-only model")
        elif is_batch:
            if not isinstance(image_data, list) or len(image_data) != len(token_ids):
                raise ValueError("The length of image_data should be equal to the batch size.")
            per_prompt = image_data
        else:
            per_prompt = [image_data]
        mms: list[object] = []
        for i, images in enumerate(per_prompt):
            if self.vl is None:
                mms.append(None)
                continue
            token_ids[i], mm = prepare_images(self.vl, token_ids[i], images, self.dtype)
            mms.append(mm)
        return mms

    def _check_context(self, input_tokens: int, max_new_tokens: int) -> None:
        """SGLang's context-length checks (TokenizerManager._validate_one_request), with its wording."""
        ctx = self.context_len
        if ctx is None:
            return
        if input_tokens >= ctx:
            raise ValueError(
                f"The input ({input_tokens} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        if input_tokens + max_new_tokens > ctx:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
                f"requested a total of {input_tokens + max_new_tokens} tokens: {input_tokens} tokens from the "
                f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                "tokens in the input messages or the completion to fit within the limit."
            )

    # ------------------------------------------------------------------ admin (run on the scheduler thread)
    def admin_ops(self) -> dict[str, Callable[..., object]]:
        """The admin operations `run` dispatches, by the name the server's routes use."""
        return {
            "abort": self._op_abort,
            "pause": self._op_pause,
            "continue": self._op_continue,
            "flush_cache": self._op_flush_cache,
            "begin_weight_update": self._op_begin_weight_update,
            "end_weight_update": self._op_end_weight_update,
            "update_weights_from_tensor": self._op_update_weights_from_tensor,
            "update_weights_from_distributed": self._op_update_weights_from_distributed,
            "update_weights_from_disk": self._op_update_weights_from_disk,
            "weight_window_layout": self._op_weight_window_layout,  # miles-only: miles.engines.local.window
            "update_weights_from_window": self._op_update_weights_from_window,
            "release_memory_occupation": self._op_release_memory_occupation,
            "resume_memory_occupation": self._op_resume_memory_occupation,
            "get_weights_by_name": self._op_get_weights_by_name,
            "weights_checker": self._op_weights_checker,
            "destroy_weights_update_group": self._op_destroy_weights_update_group,
            "load_lora_adapter": self._op_load_lora_adapter,
            "unload_lora_adapter": self._op_unload_lora_adapter,
        }

    def run(self, op: str, **kwargs: JSON) -> Future[object]:
        """Run admin operation `op` (a key of `admin_ops`) with `kwargs` on the scheduler thread."""
        fn = self.admin_ops().get(op)
        if fn is None:
            raise ValueError(f"unknown admin operation {op!r}; known: {sorted(self.admin_ops())}")
        return self.scheduler.call(lambda: fn(**kwargs))

    def _op_abort(self, rid: str = "", abort_all: bool = False) -> Reply:
        n = self.scheduler.abort(rid=rid or None, abort_all=abort_all)
        return {"success": True, "message": f"aborted {n} request(s)"}

    def _op_pause(self, mode: str = "abort") -> PauseReply:
        self.scheduler.set_paused(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}  # SGLang's body

    def _op_continue(self, torch_empty_cache: bool = True) -> PauseReply:
        if torch_empty_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.scheduler.set_paused(None)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _op_load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoraReply:
        if not isinstance(self.runner, PoolRunner):
            raise ValueError(
                "LoRA adapters need the KV-pool runner; this model runs the full-forward fallback"
            )
        self.adapters.load(lora_name, lora_path)
        return self._lora_reply()

    def _op_unload_lora_adapter(self, lora_name: str) -> LoraReply:
        users = self.scheduler.requests_using(lora_name)
        if users:  # SGLang waits for them; the refit unloads only between rollouts, so none should run
            raise RefitRefused(f"LoRA adapter {lora_name!r} is used by {users} running or waiting requests")
        self.adapters.unload(lora_name)
        return self._lora_reply()

    def _lora_reply(self) -> LoraReply:
        loaded = {name: a.path for name, a in self.adapters.loaded.items()}
        return {"success": True, "error_message": None, "loaded_adapters": loaded}

    def model_cards(self) -> dict[str, JSON]:
        """Body of GET /v1/models (SGLang's): the base model, then every loaded adapter (its `parent`)."""
        base: dict[str, JSON] = {
            "id": self.model_path,
            "object": "model",
            "root": self.model_path,
            "max_model_len": self.context_len,
        }
        cards: list[JSON] = [base]
        for name, a in list(self.adapters.loaded.items()):  # a copy: loads run on the scheduler thread
            cards.append({"id": name, "object": "model", "root": a.path, "parent": self.model_path})
        return {"object": "list", "data": cards}

    def _set_version(self, weight_version: str | None) -> None:
        if weight_version is not None and str(weight_version) != self.weight_version:
            self.scheduler.record_version_change(self.weight_version)
            self.weight_version = str(weight_version)

    # ------------------------------------------------------------------ info
    def model_info(self) -> ModelInfo:
        """Body of GET /get_model_info."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": self.vl is not None,
            "has_audio_understanding": False,
            "model_type": self.model.config.model_type,
            "architectures": getattr(self.model.config, "architectures", None),
        }

    def server_info(self, host: str, port: int) -> dict[str, JSON]:
        """Body of GET /get_server_info: the startup options plus live state."""
        stats = dict(self.scheduler.stats)
        kernel = self.runner.active_decode_kernel()  # how decode steps attend now: the CPU kernel or matmuls
        secs = stats["decode_seconds"]
        stats["decode_tokens_per_s"] = stats["decode_tokens"] / secs if secs > 0 else 0.0
        # miles-only (no SGLang counterpart): this engine takes delta refits (miles.refit.delta), which leave out
        # tensors it holds; the version it serves with every tensor loaded since its last resume, else null
        intact = None if self.weights.released or self.weights.pending else self.weight_version
        return {
            "engine": "miles-local",
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "host": host,
            "port": port,
            "tp_size": 1,
            "dp_size": 1,
            "dtype": self.config.dtype,
            "device": str(self.device),
            "max_running_requests": self.config.max_running_requests,
            "max_total_num_tokens": self.config.max_total_tokens,
            "random_seed": self.config.random_seed,
            "kv_cache": "slot pool" if self.runner.uses_kv_cache else "none (full forward per step)",
            "kv_cache_bytes": self.runner.kv_allocated_bytes(),
            "decode_attention": "matmul" if kernel is None else f"cpu kernel {kernel.path.name}",
            "context_length": self.context_len,
            "chunked_prefill_size": self.config.chunked_prefill_size,
            "weight_version": self.weight_version,
            "refit_delta_version": intact,
            "paused": self.scheduler.paused,
            "weights_released": self.weights.released,
            "kv_cache_released": self.kv_released,
            "pending_weight_tensors": len(self.weights.pending),
            "internal_states": [{**stats, **self.scheduler.load()}],
            "version": "miles-local-0.1",
        }
