"""`RolloutRunner`: data source -> generate -> filter -> score -> metrics, as a plain object (no Ray).

The runner talks to the engines only over HTTP (one long-lived generate client: the engine itself when there is
one, else the router; engine URLs for aborts), so tests build it against a real embedded engine process or a
fake HTTP server. The Ray actor in `miles.ray.rollout_manager`
wraps one. Each `generate` call runs the whole-rollout function (`--rollout-function-path`, by default
`miles.rollout.default_rollout.generate_rollout`) on the runner's event loop, checks what it returns (groups
of `--n-samples-per-prompt` samples; with `--use-session-server` at least that many: every picked leaf of the
group's sessions), numbers the batch (`index` in batch order, `group_index`), masks samples that ended
aborted, sets the trained rewards, computes the `rollout/*` metrics and writes the detail dump, in that order:
a failure anywhere leaves no dump behind.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, TypeVar

from miles.config import required
from miles.rollout.base_types import (
    EvalOutput,
    EvalSet,
    GenerateContext,
    RolloutContext,
    RolloutOutput,
    RolloutSettings,
    SamplingSettings,
)
from miles.rollout.data_source import PromptDataset, RolloutDataSource
from miles.rollout.generate_client import GenerateClient
from miles.rollout.metrics import rollout_metrics
from miles.rollout.rm_hub import RewardContext, RewardScorer
from miles.rollout.seams import Seams, load_seams
from miles.utils.httpx_import import lean_httpx
from miles.utils.types import Sample, SampleStatus

with lean_httpx():  # not its command-line client's imports (~0.1 s of CPU per process)
    import httpx

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from miles.config.sections import DataConfig, EvalConfig, RolloutConfig
    from miles.rollout.multimodal import VLProcessor

T = TypeVar("T")


class RolloutState(TypedDict):
    """What a checkpoint keeps of the rollout side (JSON-able)."""

    data_source: dict[str, int]  # the data cursor: {"epoch", "offset"}
    # the partial-rollout buffer: unfinished groups as `Sample.to_dict()` records (older checkpoints: none)
    buffer: NotRequired[list[list[dict[str, Any]]]]
    # --fully-async: the generation worker's state (`AsyncGenerationWorker.state_dict`, its data cursor aside)
    async_worker: NotRequired[dict[str, Any]]


def sampling_settings(rollout_cfg: RolloutConfig) -> SamplingSettings:
    """Training-rollout sampling from the `rollout` config section."""
    r = rollout_cfg
    return SamplingSettings(
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=r.rollout_top_k,
        max_new_tokens=r.rollout_max_response_len,
        stop=r.rollout_stop,
        stop_token_ids=r.rollout_stop_token_ids,
        skip_special_tokens=r.rollout_skip_special_tokens,
    )


def eval_sampling_settings(rollout_cfg: RolloutConfig, eval_cfg: EvalConfig) -> SamplingSettings:
    """Eval sampling: the `--eval-*` settings (validation resolves each unset one to its rollout counterpart)."""
    r, ev = rollout_cfg, eval_cfg
    return SamplingSettings(
        temperature=ev.eval_temperature,
        top_p=ev.eval_top_p,
        top_k=ev.eval_top_k,
        max_new_tokens=ev.eval_max_response_len,
        stop=r.rollout_stop,
        stop_token_ids=r.rollout_stop_token_ids,
        skip_special_tokens=r.rollout_skip_special_tokens,
    )


def reward_context(rollout_cfg: RolloutConfig) -> RewardContext:
    """The settings reward functions get (`--rm-url` without `--rm-type` means `remote_rm`)."""
    r = rollout_cfg
    return RewardContext(
        rm_type=r.rm_type or ("remote_rm" if r.rm_url else None),
        reward_key=r.reward_key,
        rm_url=r.rm_url,
        rm_timeout=r.rm_timeout,
        rm_max_retries=r.rm_max_retries,
        max_response_len=r.rollout_max_response_len,
        n_samples_per_prompt=r.n_samples_per_prompt,
    )


def build_scorer(rollout_cfg: RolloutConfig) -> RewardScorer:
    """The reward scorer of the `rollout` config section (loads and checks the reward functions)."""
    r = rollout_cfg
    return RewardScorer(
        reward_context(r),
        custom_rm_path=r.custom_rm_path,
        group_rm=r.group_rm,
        error_as_zero=r.rm_error_as_zero,
        post_process_path=r.custom_reward_post_process_path,
        timeout=r.reward_timeout,
    )


def dump_samples(path: Path, samples: list[Sample]) -> None:
    """Write samples as JSON lines atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict(), default=str) + "\n")
    os.replace(tmp, path)


async def serving_adapter(client: GenerateClient) -> str:
    """The newest miles LoRA adapter the engines list (`GET /v1/models`; see `miles.refit.lora_adapter`).
    RuntimeError when none lists one: rolling out with the base model instead would go unnoticed."""
    from miles.refit.lora_adapter import adapter_names_in, newest_adapter

    names: list[str] = []
    for url in client.engine_urls:
        try:
            resp = await client.http.get(f"{url}/v1/models", timeout=30.0)
            names += adapter_names_in(resp.json()) if resp.is_success else []
        except (httpx.HTTPError, ValueError):
            continue  # an engine that is down serves nothing; the others decide
    newest = newest_adapter(names)
    if newest is None:
        raise RuntimeError(
            f"--lora-refit adapter: no engine of {client.engine_urls} lists a miles LoRA adapter on GET /v1/models "
            "(was the refit skipped, or were the SGLang engines started without --enable-lora?)"
        )
    return newest


class RolloutRunner:
    """Generates training rollouts and evaluations against the engines behind `router_url`."""

    def __init__(
        self,
        data_cfg: DataConfig,
        rollout_cfg: RolloutConfig,
        eval_cfg: EvalConfig,
        tokenizer: PreTrainedTokenizerBase,
        router_url: str,
        engine_urls: list[str],
        api_key: str | None,
        concurrency: int,
        dump_dir: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        via_router: bool = False,
        lora_adapters: bool = False,
    ) -> None:
        """`transport` replaces the network for the generate client (tests: an in-process fake engine);
        `via_router` sends generation through the router instead of straight to the engines; `lora_adapters`
        (--lora-refit adapter): every request names the LoRA adapter the engines serve (`serving_adapter`)."""
        self.transport = transport
        self.via_router = via_router
        self.lora_adapters = lora_adapters
        self.data_cfg, self.rollout_cfg, self.eval_cfg = data_cfg, rollout_cfg, eval_cfg
        self.tokenizer = tokenizer
        self.router_url, self.engine_urls = router_url, list(engine_urls)
        self.api_key, self.concurrency = api_key, concurrency
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.seams: Seams = load_seams(rollout_cfg, eval_cfg)
        self.scorer = build_scorer(rollout_cfg)
        r = rollout_cfg
        self.settings = RolloutSettings(
            rollout_batch_size=r.rollout_batch_size,
            n_samples_per_prompt=r.n_samples_per_prompt,
            over_sampling_batch_size=r.over_sampling_batch_size,
            sampling=sampling_settings(r),
            partial_rollout=r.partial_rollout,
            mask_offpolicy_in_partial_rollout=r.mask_offpolicy_in_partial_rollout,
            reward_key=r.reward_key,
        )
        self._processor: VLProcessor | None = None  # --multimodal-keys: the checkpoint's, made on first use
        self.data_source = RolloutDataSource(
            self._dataset(data_cfg.prompt_data, data_cfg.input_key, data_cfg.label_key),
            n_samples_per_prompt=r.n_samples_per_prompt,
            shuffle=data_cfg.rollout_shuffle,
            seed=r.rollout_seed,
        )
        self._eval_datasets: dict[str, PromptDataset] = {}
        self._states_after: dict[int, RolloutState] = {}  # rollout id -> state_dict() right after it
        # one event loop and one generate client (connection pool, TLS context) for the runner's lifetime
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generate_client: GenerateClient | None = None

    def connect(self, router_url: str, engine_urls: list[str], concurrency: int) -> None:
        """Point the runner at its engines (the driver builds the runner while the engines still start; see
        `miles.ray.rollout_manager`). Only before the first request: the generate client is made on first use."""
        if self._generate_client is not None:
            raise RuntimeError(
                "RolloutRunner.connect: the generate client already exists (connect before generating)"
            )
        self.router_url, self.engine_urls, self.concurrency = router_url, list(engine_urls), concurrency

    def _run(self, fn: Callable[[GenerateClient], Awaitable[T]]) -> T:
        """Run `fn(client)` to completion on the runner's long-lived loop and client (made on first use)."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
            self._generate_client = None
        loop = self._loop
        if self._generate_client is None:
            self._generate_client = loop.run_until_complete(self.make_client().__aenter__())
        client = self._generate_client
        client.resume()
        if self.lora_adapters:  # asked before every rollout: a refit loads a new adapter between two
            client.lora_path = loop.run_until_complete(serving_adapter(client))
        try:
            return loop.run_until_complete(fn(client))
        except BaseException:
            self.close()  # a failed rollout leaves no half-done requests or queues on the next one's loop
            raise

    def close(self) -> None:
        """Close the generate client and the event loop (idempotent)."""
        loop, client = self._loop, self._generate_client
        self._loop = self._generate_client = None
        if loop is None or loop.is_closed():
            return
        try:
            if client is not None:
                loop.run_until_complete(client.__aexit__(None, None, None))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    @property
    def generate_requests_sent(self) -> int:
        """POST /generate requests this runner's client has sent (a batch counts once)."""
        return 0 if self._generate_client is None else self._generate_client.requests_sent

    def _dataset(self, path: str, input_key: str, label_key: str | None) -> PromptDataset:
        d = self.data_cfg
        return PromptDataset(
            path,
            input_key=input_key,
            label_key=label_key,
            metadata_key=d.metadata_key,
            tokenizer=self.tokenizer,
            apply_chat_template=d.apply_chat_template,
            max_prompt_len=self.rollout_cfg.rollout_max_prompt_len,
            multimodal_keys=d.multimodal_keys or None,
            processor=self._vl_processor(),
        )

    def _vl_processor(self) -> VLProcessor | None:
        """The checkpoint's VL processor when --multimodal-keys names image fields (made once)."""
        if not self.data_cfg.multimodal_keys:
            return None
        if self._processor is None:
            from miles.rollout.multimodal import VLProcessor

            self._processor = VLProcessor.for_tokenizer(self.tokenizer)
        return self._processor

    def make_client(self) -> GenerateClient:
        """A new generate client for this runner's engines (enter it with `async with`); the fully async
        worker keeps its own on its own thread."""
        return GenerateClient(
            self.router_url,
            self.engine_urls,
            self.api_key,
            timeout=float(self.rollout_cfg.rollout_request_timeout),
            concurrency=self.concurrency,
            transport=self.transport,
            seed=self.rollout_cfg.rollout_seed,
            via_router=self.via_router,
            return_routed_experts=self.rollout_cfg.use_rollout_routing_replay,
        )

    def context(self, client: GenerateClient) -> RolloutContext:
        """What rollout functions get: `client`, the data source, settings, seams and scorer."""
        return RolloutContext(
            client=client,
            data_source=self.data_source,
            settings=self.settings,
            generate=self.seams.generate,
            generate_ctx=GenerateContext(
                tokenizer=self.tokenizer,
                request_id_prefix="rollout",
                multi_turn=self.seams.multi_turn,
                agent=self.seams.agent,
            ),
            group_filter=self.seams.group_filter,
            scorer=self.scorer,
            generate_name=self.seams.generate_name,
            filter_name=self.seams.filter_name,
        )

    # ------------------------------------------------------------------------------------------ training
    def set_start_rollout(self, rollout_id: int) -> None:
        """Position the data cursor for a run resumed at `rollout_id` (one batch of prompts per rollout; with
        over-sampling or a filter the count of prompts actually drawn is not restored)."""
        consumed = rollout_id * required(self.rollout_cfg.rollout_batch_size, "--rollout-batch-size")
        size = len(self.data_source.dataset)
        self.data_source.load_state_dict({"epoch": consumed // size, "offset": consumed % size})

    def state_dict(self, after_rollout: int | None = None) -> RolloutState:
        """What a checkpoint keeps of the rollout side (JSON-able): the data cursor and the partial-rollout
        buffer (unfinished groups, as `Sample.to_dict()` records); with `after_rollout`, as they were right
        after that rollout (the one-step-off loop saves while the next rollout already draws prompts)."""
        if after_rollout is not None:
            if after_rollout not in self._states_after:
                raise ValueError(
                    f"no rollout state kept for rollout {after_rollout}; kept: {sorted(self._states_after)}"
                )
            return self._states_after[after_rollout]
        ds = self.data_source
        return {
            "data_source": ds.state_dict(),
            "buffer": [[s.to_dict() for s in group] for group in ds.buffer],
        }

    def load_state_dict(self, state: RolloutState) -> None:
        """Resume from a `state_dict()` (ValueError when it does not fit this dataset)."""
        self.data_source.load_state_dict(state["data_source"])
        self.data_source.buffer = [[Sample.from_dict(d) for d in group] for group in state.get("buffer", [])]

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """One training rollout: the samples (prompt groups contiguous, numbered) and the `rollout/*` metrics."""

        out = self._run(lambda client: self.seams.rollout(self.context(client), rollout_id))
        self._states_after = {k: v for k, v in self._states_after.items() if k >= rollout_id - 1}
        self._states_after[rollout_id] = self.state_dict()
        return self.finish_rollout(out, rollout_id)

    def finish_rollout(self, out: object, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Check a rollout function's output, number the batch, set the trained rewards, compute the
        `rollout/*` metrics and write the detail dump (also the fully async worker's batches)."""
        samples = self._check_output(out)
        assert isinstance(out, RolloutOutput)  # _check_output raised otherwise
        self.scorer.set_train_rewards(samples)
        metrics = rollout_metrics(samples, self.settings.reward_key, 0)
        metrics["rollout/dropped_prompts"] = float(self.data_source.dataset.num_filtered)  # too long, at load
        metrics.update({k: float(v) for k, v in out.metrics.items()})
        if self.dump_dir is not None:
            dump_samples(self.dump_dir / f"rollout_{rollout_id:07d}.jsonl", samples)
        return samples, metrics

    def _check_output(self, out: object) -> list[Sample]:
        name, s = self.seams.rollout_name, self.settings
        if not isinstance(out, RolloutOutput):
            raise ValueError(
                f"rollout function {name} returned {type(out).__name__}; expected a RolloutOutput"
            )
        if len(out.groups) != s.rollout_batch_size:
            raise ValueError(
                f"rollout function {name} returned {len(out.groups)} prompt groups; "
                f"--rollout-batch-size is {s.rollout_batch_size}"
            )
        samples: list[Sample] = []
        sessions = self.seams.agent is not None  # a group holds every picked leaf of its sessions
        for gi, group in enumerate(out.groups):
            if len(group) < s.n_samples_per_prompt or (len(group) > s.n_samples_per_prompt and not sessions):
                raise ValueError(
                    f"rollout function {name}: group {gi} has {len(group)} samples; --n-samples-per-prompt is "
                    f"{s.n_samples_per_prompt}"
                    + (" (at least that many with --use-session-server)" * sessions)
                )
            for j, sample in enumerate(group):
                problem = sample.check_consistent() if isinstance(sample, Sample) else "is not a Sample"
                if problem is None and sample.status == SampleStatus.PENDING:
                    problem = "has status 'pending' (never generated)"
                if problem is None and sample.reward is None:
                    problem = "has no reward"
                if problem:
                    raise ValueError(
                        f"rollout function {name}: group {gi} sample {j} (index {sample.index}) {problem}"
                    )
                sample.index, sample.group_index = len(samples), gi
                if sample.status == SampleStatus.ABORTED:  # nothing finished to learn from
                    sample.loss_mask = [0] * sample.response_length
                samples.append(sample)
        return samples

    # ------------------------------------------------------------------------------------------ eval
    def eval_sets(self) -> list[EvalSet]:
        """One `EvalSet` per `--eval-prompt-data` pair (datasets read once, then cached)."""
        ev = self.eval_cfg
        sampling = eval_sampling_settings(self.rollout_cfg, ev)
        sets = []
        for name, path in ev.eval_datasets:
            if name not in self._eval_datasets:
                self._eval_datasets[name] = self._dataset(path, ev.eval_input_key, ev.eval_label_key)
            source = RolloutDataSource(
                self._eval_datasets[name],
                n_samples_per_prompt=ev.n_samples_per_eval_prompt,
                shuffle=False,
                seed=0,
            )
            sets.append(EvalSet(name, source, sampling, ev.n_samples_per_eval_prompt))
        return sets

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Run the eval function over every eval set; returns its metrics (`eval/<set>...`). `rollout_id` -1
        is the evaluation before training."""
        sets = self.eval_sets()

        out = self._run(lambda client: self.seams.evaluate(self.context(client), sets, rollout_id))
        if not isinstance(out, EvalOutput):
            raise ValueError(
                f"eval function {self.seams.eval_name} returned {type(out).__name__}; expected EvalOutput"
            )
        if self.dump_dir is not None:
            tag = "before_train" if rollout_id < 0 else f"{rollout_id:07d}"
            for name, samples in out.samples.items():
                dump_samples(self.dump_dir / f"eval_{name}_{tag}.jsonl", samples)
        return {k: float(v) for k, v in out.metrics.items()}
