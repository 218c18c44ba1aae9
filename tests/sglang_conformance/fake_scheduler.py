"""A stand-in for SGLang's scheduler process, for the conformance suite (runs inside .venv-sglang only).

SGLang's `TokenizerManager` talks to its scheduler over two ZMQ sockets. This module is the other end of those
sockets, in a thread of the server process: it decodes what the real `TokenizerManager` sends (SGLang's own wire
encoding), and answers with SGLang's own output structs. Control requests go into SGLang's real bookkeeping:

- `SchedulerWeightUpdaterManager` (sglang/srt/managers/scheduler_components/weight_updater.py): the weight-update
  session, release/resume tags (`offload_tags`), the idle assertion of release, flush after update;
- `WeightUpdater` (sglang/srt/model_executor/model_runner_components/weight_updater.py): deserialising tensor
  handles, joining the broadcast group with SGLang's `init_custom_process_group`, receiving broadcasts;
- `WeightChecker` (sglang/srt/utils/weight_checker.py): per-tensor checksums.

Only the model and the memory saver are ours: a tiny HF model on CPU (its `load_weights` copies by exact name and
shape, as SGLang's loaders index `params_dict[name]`), and a memory saver that behaves like torch_memory_saver under
SGLang's flags: with `--enable-memory-saver` a pause frees the tagged region (weights become NaN until reloaded),
`cuda_graph` is a region only with SGLANG_MEMORY_SAVER_CUDA_GRAPH=true, and without the flag pause does nothing.

An exception in a handler kills the server the way SGLang's scheduler death does (SIGQUIT to the server process).
A prompt equal to `RETRACTED_PROMPT` is aborted the way SGLang's decode retraction aborts a request it cannot keep
(`FINISH_ABORT` with status 503, "Retracted under decode memory pressure ... Retry later"), every time.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from array import array
from typing import Any

import torch

logger = logging.getLogger("miles.conformance.scheduler")
RETRACTED_PROMPT = [9, 9, 9, 9, 9, 9, 9]


class MemorySaver:
    """torch_memory_saver's contract as SGLang uses it (pause/resume by tag), observable by the tests."""

    def __init__(self, enabled: bool, cuda_graph_region: bool, on_pause: Any, on_resume: Any) -> None:
        self.enabled = enabled
        self.regions = {"weights", "kv_cache"} | ({"cuda_graph"} if cuda_graph_region else set())
        self.paused: set[str] = set()
        self._on_pause, self._on_resume = on_pause, on_resume

    def pause(self, tag: str) -> None:
        if self.enabled and tag in self.regions:
            self.paused.add(tag)
            self._on_pause(tag)

    def resume(self, tag: str) -> None:
        if self.enabled and tag in self.paused:
            self.paused.discard(tag)
            self._on_resume(tag)

    def state(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "regions": sorted(self.regions), "paused": sorted(self.paused)}


def with_load_weights(hf_model: torch.nn.Module) -> torch.nn.Module:
    """The served HF model with SGLang's model interface: `load_weights(iterable of (name, tensor))`."""

    def load_weights(weights: Any) -> None:
        params = dict(hf_model.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            param = params[name]  # KeyError for a name the model does not have, as in SGLang's loaders
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(param.shape)}")
            with torch.no_grad():
                param.data.copy_(tensor.to(param.dtype))

    hf_model.load_weights = load_weights
    return hf_model


class FakeScheduler:
    """The scheduler end of the TokenizerManager's sockets, run in a thread."""

    def __init__(self, server_args: Any, port_args: Any) -> None:
        import zmq
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.utils.network import get_zmq_socket
        from sglang.srt.utils.weight_checker import WeightChecker
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.server_args = cfg = resolving_view(server_args)  # the values after SGLang's own resolution
        path = cfg.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or path)
        self.model = with_load_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        self.random_seed = int(cfg.random_seed)
        self.engine_paused = False
        self.running = 0
        context = zmq.Context(2)
        self.recv = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        self.send = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False)
        cuda_graph_env = os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "false").lower() in ("1", "true")
        self.memory = MemorySaver(
            bool(cfg.enable_memory_saver), cuda_graph_env, self._on_pause, self._on_resume
        )
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(
            tp_rank=0, pp_rank=0, dp_rank=None
        )  # this process is the (only) TP rank
        self.runner = _Runner(self)
        self.runner.weight_updater = WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=lambda **kw: None,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: self.runner,
        )  # fmt: skip
        self.runner.checker = WeightChecker(get_model=lambda: self.model)
        self.tp_worker = _TpWorker(self.runner)
        self.updater = _Updater(
            tp_worker=self.tp_worker, draft_worker=None, memory_saver_adapter=self.memory,
            flush_cache=self._flush_cache, is_fully_idle=self._is_fully_idle, scheduler=self,
        )  # fmt: skip
        assert isinstance(self.updater, SchedulerWeightUpdaterManager)
        self.disaggregation_mode = None
        self._engine_paused = False
        self.weight_version_changes: list[str | None] = []
        self._thread = threading.Thread(target=self._loop, name="fake-scheduler", daemon=True)

    # ------------------------------------------------------------------ hooks SGLang's managers call
    def record_weight_version_change(self, new_version: str | None) -> None:
        self.weight_version_changes.append(new_version)

    def _flush_cache(self, empty_cache: bool = False) -> bool:
        return self._is_fully_idle()

    def _is_fully_idle(self, ignore_waiting: bool = False, for_health_check: bool = False) -> bool:
        return self.running == 0

    def _on_pause(self, tag: str) -> None:
        if tag == "weights":
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))  # the memory is gone; what comes back is garbage until reloaded

    def _on_resume(self, tag: str) -> None:
        pass

    # ------------------------------------------------------------------ loop
    def info(self) -> dict[str, Any]:
        ctx = int(self.model.config.max_position_embeddings)
        return {"status": "ready", "max_total_num_tokens": 4 * ctx, "max_req_input_len": ctx - 1}

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        from sglang.srt.managers.io_struct import sock_recv, sock_send

        while True:
            req = sock_recv(self.recv)
            try:
                out = self.dispatch(req)
            except BaseException:  # noqa: BLE001 - the real scheduler dies here and takes the server down
                logger.error("fake scheduler died on %s:\n%s", type(req).__name__, traceback.format_exc())
                os.kill(os.getpid(), signal.SIGQUIT)
                return
            for o in out:
                sock_send(self.send, o)

    def dispatch(self, req: Any) -> list[Any]:
        from sglang.srt.managers import io_struct as io

        u = self.updater
        control = {
            io.BeginWeightUpdateReqInput: u.begin_weight_update,
            io.EndWeightUpdateReqInput: u.end_weight_update,
            io.UpdateWeightsFromTensorReqInput: u.update_weights_from_tensor,
            io.UpdateWeightsFromDistributedReqInput: u.update_weights_from_distributed,
            io.InitWeightsUpdateGroupReqInput: u.init_weights_update_group,
            io.DestroyWeightsUpdateGroupReqInput: u.destroy_weights_update_group,
            io.ReleaseMemoryOccupationReqInput: u.release_memory_occupation,
            io.ResumeMemoryOccupationReqInput: u.resume_memory_occupation,
            io.GetWeightsByNameReqInput: u.get_weights_by_name,
            io.CheckWeightsReqInput: u.check_weights,
        }
        if type(req) in control:
            return [control[type(req)](req)]
        if isinstance(req, io.TokenizedGenerateReqInput):
            return [self.generate([req])]
        if isinstance(req, io.BatchTokenizedGenerateReqInput):
            return [self.generate(list(req.batch))]
        if isinstance(req, io.FreezeGCReq):
            return []  # the warm-up's gc.freeze: nothing to do in a thread
        if isinstance(req, io.AbortReq):
            return []  # requests run to completion inside dispatch: nothing is in flight to abort
        if isinstance(req, io.FlushCacheReqInput):
            return [io.FlushCacheReqOutput(success=self._is_fully_idle())]
        if isinstance(req, io.PauseGenerationReqInput):
            self._engine_paused = True
            return []
        if isinstance(req, io.ContinueGenerationReqInput):
            self._engine_paused = False
            return []
        if isinstance(req, io.GetInternalStateReq):
            state = {"memory_saver": self.memory.state(), "offload_tags": sorted(u.offload_tags),
                     "weight_version_changes": self.weight_version_changes,
                     "session_open": u._session is not None}  # fmt: skip
            return [io.GetInternalStateReqOutput(internal_state=state)]
        raise NotImplementedError(f"the conformance scheduler does not handle {type(req).__name__}")

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, reqs: list[Any]) -> Any:
        from sglang.srt.managers.io_struct import BatchStrOutput

        rows = [self._generate_one(r) for r in reqs]
        n = len(rows)
        fields = dict(
            rids=[r.rid for r in reqs],
            finished_reasons=[row["finish"] for row in rows],
            output_strs=[row["text"] for row in rows],
            output_ids=[array(r.input_ids.typecode, row["ids"]) for r, row in zip(reqs, rows)],
            prompt_tokens=[len(r.input_ids) for r in reqs],
            completion_tokens=[len(row["ids"]) for row in rows],
            reasoning_tokens=[0] * n,
            cached_tokens=[0] * n,
            retraction_counts=[0] * n,
            output_token_logprobs_val=[row["logprobs"] if r.return_logprob else None for r, row in zip(reqs, rows)],
            output_token_logprobs_idx=[row["ids"] if r.return_logprob else None for r, row in zip(reqs, rows)],
        )  # fmt: skip
        for name in BatchStrOutput.__struct_fields__:
            if name not in fields and name in _required(BatchStrOutput):
                fields[name] = [None] * n if name not in ("rids",) else None
        return BatchStrOutput(**fields)

    def _generate_one(self, req: Any) -> dict[str, Any]:
        sp = req.sampling_params
        ids = list(req.input_ids)
        if ids == RETRACTED_PROMPT:  # schedule_batch.py retract_decode, without a KV backup
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            message = "Retracted under decode memory pressure without a KV backup. Retry later."
            finish = FINISH_ABORT(message, status_code=503).to_json()
            return {"ids": [], "logprobs": [], "finish": finish, "text": ""}
        gen = torch.Generator().manual_seed(self.random_seed * 1_000_003 + (hash(req.rid) & 0xFFFF))
        eos = self.tokenizer.eos_token_id
        out: list[int] = []
        logprobs: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": sp.max_new_tokens}
        temperature = float(sp.temperature)
        for _ in range(int(sp.max_new_tokens)):
            logits = self.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
            if temperature <= 1e-6:
                token = int(torch.argmax(logits))
                lp = torch.log_softmax(logits, -1)[token]
            else:
                probs = torch.softmax(logits / temperature, -1)
                token = int(torch.multinomial(probs, 1, generator=gen))
                lp = torch.log(probs[token])
            out.append(token)
            logprobs.append(float(lp))
            if (not sp.ignore_eos and token == eos) or token in (sp.stop_token_ids or set()):
                finish = {"type": "stop", "matched": token}
                break
        return {"ids": out, "logprobs": logprobs, "finish": finish, "text": self.tokenizer.decode(out)}


def _required(struct: Any) -> set[str]:
    import msgspec

    return {f.name for f in msgspec.structs.fields(struct) if f.required}


class _Runner:
    """The parts of SGLang's ModelRunner that the weight-update managers call."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        self.scheduler = scheduler
        self.weight_updater: Any = None
        self.checker: Any = None
        self.model = scheduler.model

    def check_weights(self, action: str, allow_quant_error: bool, skip_tensor_list: Any, role: str) -> Any:
        return self.checker.handle(
            action=action, allow_quant_error=allow_quant_error, skip_tensor_list=skip_tensor_list, role=role
        )


class _TpWorker:
    """The parts of SGLang's TpModelWorker that the weight-update managers call; the methods are SGLang's."""

    def __init__(self, runner: _Runner) -> None:
        self.model_runner = runner
        self._model_runner = runner

    def weight_update_runners(self) -> list[tuple[str, Any]]:
        return [("target", self.model_runner)]

    def deserialize_own_rank(self, serialized: Any) -> Any:
        from sglang.srt.managers.tp_worker import TpModelWorker

        return TpModelWorker.deserialize_own_rank(self, serialized)

    def init_weights_update_group(self, recv_req: Any) -> Any:
        from sglang.srt.managers.tp_worker import TpModelWorker

        return TpModelWorker.init_weights_update_group(self, recv_req)

    def destroy_weights_update_group(self, recv_req: Any) -> Any:
        from sglang.srt.managers.tp_worker import TpModelWorker

        return TpModelWorker.destroy_weights_update_group(self, recv_req)

    def get_weights_by_name(self, recv_req: Any) -> Any:
        params = dict(self.model_runner.model.named_parameters(remove_duplicate=False))
        if recv_req.name not in params:
            return None
        return params[recv_req.name].flatten()[: recv_req.truncate_size].tolist()


def _updater_class() -> type:
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    class Updater(SchedulerWeightUpdaterManager):
        """SGLang's manager with a one-process gloo group as its TP CPU group (TP=1)."""

        def __post_init__(self) -> None:
            self.tp_cpu_group = _world_one_group()

    return Updater


def _Updater(**kwargs: Any) -> Any:  # noqa: N802 - reads as the class it builds
    return _updater_class()(**kwargs)


_GROUP: Any = None


def _world_one_group() -> Any:
    """A default gloo group of size 1 (SGLang's barriers and weight updater assert one exists)."""
    global _GROUP
    import torch.distributed as dist

    if _GROUP is None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _GROUP = dist.group.WORLD
    return _GROUP
