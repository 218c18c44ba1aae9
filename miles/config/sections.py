"""The configuration sections: every flag is declared exactly once here (the rollout section in
`rollout_section.py`, re-exported here), with a one-line doc.

A field `rollout_batch_size` in section `rollout` is the CLI flag `--rollout-batch-size`, the YAML key
`rollout-batch-size` (or `rollout_batch_size`, flat or under `rollout:`) and the attribute
`cfg.rollout.rollout_batch_size`. The argparse parser (`miles.config.parser`) is generated from these
declarations; field metadata carries the help line, choices, bounds (`gt`/`ge`/`lt`/`le`, checked after
merging), `required` and `implemented`.

Nothing here imports torch, ray or transformers.
"""

from __future__ import annotations

from miles.config import algo_names, registry_names
from miles.config.fields import derived, opt, resolved, section
from miles.config.rollout_section import RolloutConfig


@section
class ClusterConfig:
    """Cluster layout: training actors and rollout engines."""

    actor_num_nodes: int = opt(1, "number of nodes running training actors", ge=1)
    actor_num_gpus_per_node: int = opt(1, "training actors (GPUs, or CPU workers) per node", ge=1)
    rollout_num_gpus: int | None = opt(
        None, "GPUs for rollout engines in total; None: the actor total when --colocate, else required", ge=1
    )
    rollout_num_gpus_per_engine: int = opt(1, "GPUs per rollout engine (its tensor-parallel size)", ge=1)
    colocate: bool = opt(False, "run rollout engines on the training GPUs, offloading each side in turn")
    use_fault_tolerance: bool = opt(False, "restart rollout engines that stop answering health checks")
    cpu_engine_in_trainer: bool = opt(
        True,
        "CPU, --colocate, embedded engine: serve each engine from a thread of its training rank's process instead "
        "of a process of its own (not with --use-fault-tolerance)",
    )
    rollout_health_check_interval: float = opt(
        30.0, "--use-fault-tolerance: seconds between two health checks of an engine", gt=0
    )
    rollout_health_check_timeout: float = opt(
        30.0, "--use-fault-tolerance: seconds an engine has to answer a health check", gt=0
    )
    rollout_health_check_first_wait: float = opt(
        0.0, "--use-fault-tolerance: seconds after a rollout starts before the first health check", ge=0
    )
    train_env_vars: dict[str, str] = opt({}, "JSON object of extra environment variables for training actors")
    rollout_external: bool = opt(
        False, "use engines miles does not launch (--rollout-external-engine-addrs); implied by that flag"
    )
    rollout_external_engine_addrs: list[str] | None = opt(
        None, "HOST:PORT of running engines to generate with and refit (not launched, restarted or stopped)"
    )

    @property
    def actor_world_size(self) -> int:
        """Training processes in total: nodes * GPUs (or CPU workers) per node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@section
class ModelConfig:
    """The policy model."""

    hf_checkpoint: str = resolved("HuggingFace checkpoint dir of the policy (and tokenizer)", required=True)
    attn_implementation: str = opt(
        "sdpa",
        "attention kernel of the trained model",
        choices=("eager", "sdpa", "flash_attention_2", "flash_attention_3", "miles_varlen"),
    )
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    freeze_vision_tower: bool = opt(
        False, "VLM: train the language model only, the vision tower frozen (issue 27, refused)"
    )
    fused_elementwise: bool = opt(
        True,
        "on CUDA, run RMSNorm, rotary embedding and SwiGLU of the trained models as torch.compile'd fused kernels "
        "(same formulas; off: HF's eager modules)",
    )
    train_dtype: str = opt(
        "auto",
        "parameter dtype for training; auto: bfloat16 on GPU, float32 on CPU (resolved by the backend)",
        choices=("auto", "float32", "bfloat16"),
    )


@section
class CheckpointConfig:
    """Loading and saving checkpoints."""

    load: str | None = opt(None, "directory to resume training from (DCP checkpoints written by --save)")
    ref_load: str | None = opt(
        None, "reference model: a HF dir, or a --save dir / its iter_N (DCP); None: --hf-checkpoint"
    )
    save: str | None = opt(None, "directory to write checkpoints to")
    save_interval: int | None = opt(None, "save every N rollouts (requires --save)", ge=1)
    keep_last: int | None = opt(None, "keep only the newest N checkpoints; None: keep all", ge=1)
    save_hf: str | None = opt(
        None, "write the policy in HF format to DIR/iter_N (or to DIR formatted with {rollout_id})"
    )
    save_hf_interval: int | None = opt(
        None, "--save-hf every N rollouts and after the last; None: --save-interval, else only the last", ge=1
    )


@section
class DataConfig:
    """The prompt dataset."""

    prompt_data: str = resolved("prompt dataset file (.jsonl or .parquet)", required=True)
    input_key: str = opt("input", "dataset key holding the prompt")
    label_key: str | None = opt(None, "dataset key holding the label passed to the reward function")
    metadata_key: str = opt("metadata", "dataset key holding per-sample metadata")
    apply_chat_template: bool = opt(False, "wrap prompts with the tokenizer's chat template")
    multimodal_keys: dict[str, str] = opt(
        {},
        'JSON object: modality -> dataset field holding it, e.g. {"image": "images"} (VLM; issue 27, refused)',
    )
    rollout_shuffle: bool = opt(False, "shuffle prompts each epoch (seeded by --rollout-seed)")


@section
class EngineConfig:
    """Rollout engine servers. Any `--sglang-NAME [VALUE ...]` is passed to the server as `--NAME [VALUE ...]`."""

    engine_host: str = opt("127.0.0.1", "address rollout engines bind to")
    engine_api_key: str | None = opt(
        None,
        "key for the engines: SGLang's --api-key and --admin-api-key (only /health* answers without it; needed "
        "off localhost; default: $MILES_ENGINE_API_KEY, else one drawn per run)",
        secret=True,
    )
    engine_max_running_requests: int = opt(64, "max concurrent requests per engine", ge=1)
    check_weight_update_equal: bool = opt(
        True,
        "after every refit, compare each engine TP rank's per-tensor checksums (/weights_checker) with the "
        "trainer's, hashed while sending; a mismatch stops the run naming the engine, tensor and version",
    )
    rollout_weight_quantization: str | None = opt(
        None,
        "quantize the linear layers' weights at each refit for the engines: fp8 (e4m3, 128x128 block scales, "
        "SGLang's weight_scale_inv layout); None: send them as trained",
        choices=("fp8",),
    )
    rollout_fp8_scale_format: str = resolved(
        "with --rollout-weight-quantization fp8: float (amax/448) or ue8m0 (rounded up to a power of two, for "
        "DeepGEMM); default ue8m0 with fp8 and --sglang-moe-runner-backend deep_gemm, else float",
        choices=("float", "ue8m0"),
    )
    sglang_mem_fraction_static: float | None = opt(
        None, "SGLang: fraction of GPU memory for weights + KV cache", gt=0, lt=1
    )
    sglang_decode_log_interval: int | None = opt(None, "SGLang: decode steps between log lines", ge=1)
    sglang_chunked_prefill_size: int | None = opt(None, "SGLang: chunked prefill size in tokens; -1: off")
    sglang_attention_backend: str | None = opt(None, "SGLang: attention backend (e.g. fa3, flashinfer)")
    sglang_args: dict[str, str] = opt(
        {}, "all SGLang server args by server-arg name (collected from --sglang-* flags)", cli=False
    )


@section
class RouterConfig:
    """sglang-router in front of the engines. Any `--router-NAME VALUE` is passed to it as `--NAME VALUE`."""

    router_policy: str | None = opt(
        None,
        "sglang-router policy; when set, generation goes through the router (None: straight to the engines)",
        choices=registry_names.ROUTER_POLICIES,
        registry="sglang-router",
    )
    sglang_router_ip: str | None = opt(
        None, "address of a running sglang-router to use instead of launching one (with --sglang-router-port)"
    )
    sglang_router_port: int | None = opt(None, "port of that running sglang-router", ge=1, le=65535)
    router_args: dict[str, str] = opt(
        {},
        "sglang-router options by name, without the router- prefix (collected from --router-* flags)",
        cli=False,
    )


@section
class TrainConfig:
    """Training actors."""

    train_backend: str = opt(
        "fsdp", "training backend", choices=registry_names.TRAIN_BACKENDS, registry="miles.backends"
    )
    global_batch_size: int = resolved("samples per optimizer step", required=True, ge=1)
    micro_batch_size: int = opt(1, "samples per forward/backward (static batching)", ge=1)
    use_dynamic_batch_size: bool = opt(False, "pack micro-batches up to --max-tokens-per-gpu tokens")
    max_tokens_per_gpu: int | None = opt(None, "token budget of one packed micro-batch per GPU", ge=1)
    balance_data: bool = opt(False, "balance tokens across data-parallel ranks when splitting a rollout")
    context_parallel_size: int = opt(1, "ranks that split one sequence (context parallelism)", ge=1)
    tensor_model_parallel_size: int = opt(
        1,
        "ranks that split every decoder layer's attention heads and MLP (tensor parallelism, dense decoders and "
        "Qwen3-MoE, whose experts stay whole; innermost mesh dimension, FSDP2 shards over the data-parallel ranks)",
        ge=1,
    )
    expert_model_parallel_size: int = opt(
        1,
        "ranks that split every MoE layer's experts (expert parallelism, Qwen3-MoE; tokens reach their experts by "
        "all-to-all, FSDP2 shards the experts over the ranks holding the same ones)",
        ge=1,
    )
    fsdp_cpu_offload: bool = opt(False, "keep FSDP parameters, gradients and optimizer state on CPU")
    update_weight_buffer_size: int = opt(512 * 1024**2, "bytes per weight-refit bucket", ge=1)
    update_weight_transfer_mode: str = opt(
        "auto",
        "how a refit moves weights: tensor (handles / shared-memory window, same node), broadcast (update "
        "group: NCCL on GPU, gloo on CPU), auto (tensor when colocated, or on CPU when each engine has training ranks of its own; else "
        "broadcast)",
        choices=("auto", "tensor", "broadcast"),
    )
    update_weight_delta: str = opt(
        "none",
        "broadcast refits: changed sends only the tensors that changed since the version every engine "
        "acknowledged (engines that declare support: the embedded engine; SGLang engines get full refits); "
        "none sends everything",
        choices=("none", "changed"),
    )
    ref_update_interval: int | None = opt(
        None, "copy policy weights into the reference every N rollouts", ge=1
    )
    moe_aux_loss_coeff: float = opt(
        0.0, "MoE load-balancing loss weight (Switch/Megatron form, summed over the MoE layers)", ge=0
    )
    moe_z_loss_coeff: float = opt(
        0.0, "MoE router z-loss weight (mean logsumexp(logits)^2, summed over layers)", ge=0
    )
    use_routing_replay: bool = opt(
        False,
        "MoE: later forwards over a rollout batch replay the experts of its first training-side forward",
    )
    train_timeout: float = opt(1800.0, "seconds to wait for a collective or a Ray call", gt=0)
    refit_timeout: float = resolved(
        "seconds one engine call of a weight refit may take (an expiry names the engine); "
        "None: min(300, --train-timeout / 2)",
        gt=0,
    )
    steps_per_rollout: int = derived(
        "optimizer steps per rollout: --rollout-batch-size * --n-samples-per-prompt / --global-batch-size"
    )


def derived_refit_timeout(train_timeout: float) -> float:
    """The default --refit-timeout: 300 s, or half of --train-timeout when that is shorter (it must expire first)."""
    return min(300.0, train_timeout / 2)


@section
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = opt("adam", "optimizer (adam is AdamW)", choices=("adam", "sgd"))
    lr: float = opt(1e-6, "peak learning rate", ge=0)
    min_lr: float = opt(0.0, "learning rate at the end of decay", ge=0)
    lr_decay_style: str = opt("constant", "decay schedule", choices=("constant", "linear", "cosine"))
    lr_decay_iters: int = resolved("optimizer steps to decay over; None: all steps of the run", ge=1)
    lr_warmup_iters: int = opt(0, "optimizer steps of linear warmup", ge=0)
    lr_warmup_fraction: float | None = opt(None, "warmup as a fraction of --lr-decay-iters", ge=0, le=1)
    weight_decay: float = opt(0.0, "decoupled weight decay", ge=0)
    adam_beta1: float = opt(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = opt(0.999, "Adam beta2", ge=0, lt=1)
    adam_eps: float = opt(1e-8, "Adam epsilon", gt=0)
    clip_grad: float = opt(1.0, "max global gradient norm; 0: no clipping", ge=0)


@section
class AlgoConfig:
    """Advantages and the policy loss."""

    advantage_estimator: str = opt("grpo", "advantage estimator", choices=algo_names.ADVANTAGE_ESTIMATORS)
    policy_loss: str = resolved(
        "policy-gradient loss: PPO's token-level clipped ratio or GSPO's sequence-level one; "
        "None: gspo for --advantage-estimator gspo, else ppo",
        choices=algo_names.POLICY_LOSSES,
    )
    custom_advantage_function_path: str | None = opt(None, "user advantage function, 'module:function'")
    disable_grpo_std_normalization: bool = opt(False, "GRPO: subtract the group mean only (Dr. GRPO)")
    normalize_advantages: bool = opt(False, "whiten advantages over the batch's response tokens")
    gamma: float = opt(1.0, "discount factor (REINFORCE++, PPO's GAE)", ge=0, le=1)
    lambd: float = opt(1.0, "GAE lambda (--advantage-estimator ppo)", ge=0, le=1)
    eps_clip: float = opt(0.2, "PPO clip range, lower side", gt=0)
    eps_clip_high: float = resolved("PPO clip range, upper side; None: --eps-clip", gt=0)
    eps_clip_c: float | None = opt(None, "dual-clip constant for negative advantages (> 1); None: off", gt=1)
    use_opsm: bool = opt(False, "off-policy sequence masking")
    opsm_delta: float = opt(1e-4, "OPSM threshold on the sequence KL", gt=0)
    use_kl_loss: bool = opt(False, "add a KL(policy || reference) term to the loss")
    kl_loss_coef: float = opt(0.0, "weight of the KL loss term", ge=0)
    kl_loss_type: str = opt("k1", "KL estimator for the loss", choices=algo_names.KL_TYPES)
    kl_coef: float = opt(0.0, "KL penalty folded into the reward", ge=0)
    use_unbiased_kl: bool = opt(False, "importance-weight the KL estimate by policy / old policy")
    entropy_coef: float = opt(0.0, "weight of the entropy bonus")
    use_tis: bool = opt(False, "truncated importance sampling against rollout log-probs")
    tis_clip: float = opt(2.0, "TIS upper truncation", ge=0)
    tis_clip_low: float = opt(0.0, "TIS lower truncation", ge=0)
    use_mis: bool = opt(False, "masked importance sampling: drop tokens/sequences outside bounds")
    mis_level: str = opt("token", "MIS granularity", choices=algo_names.MIS_LEVELS)
    mis_lower: float = opt(0.5, "MIS lower bound on the ratio", ge=0)
    mis_upper: float = opt(2.0, "MIS upper bound on the ratio", gt=0)
    custom_tis_function_path: str | None = opt(None, "user TIS/MIS weight function, 'module:function'")
    use_rollout_logprobs: bool = opt(False, "use the engine's log-probs as old log-probs")
    calculate_per_token_loss: bool = opt(False, "shorthand for --loss-reduction token_mean")
    loss_reduction: str = opt(
        "sample_mean",
        "loss reduction: per-sample token mean, token mean over the batch, or sum / constant",
        choices=algo_names.LOSS_REDUCTIONS,
    )
    loss_reduction_constant: float = resolved("constant_sum divisor; None: --rollout-max-response-len", gt=0)
    custom_loss_function_path: str | None = opt(None, "user policy-loss function, 'module:function'")


@section
class CriticConfig:
    """The value model of --advantage-estimator ppo (a second FSDP2 train group, role critic)."""

    critic_load: str | None = opt(
        None, "critic init: a HF dir, or a DCP checkpoint (--save dir / iter_N); None: --hf-checkpoint"
    )
    critic_lr: float = resolved("critic peak learning rate; None: --lr", ge=0)
    critic_lr_warmup_iters: int = opt(0, "critic optimizer steps of linear warmup", ge=0)
    num_critic_only_steps: int = opt(0, "first N rollouts train the critic only (actor frozen)", ge=0)
    value_clip: float | None = opt(0.2, "clip the value change around the old value; None: off", gt=0)


@section
class LoraConfig:
    """LoRA adapters on the policy: only adapters train; refits send the adapter (or merged weights); the
    reference is the base."""

    lora_rank: int = opt(0, "LoRA rank; 0: full fine-tuning", ge=0)
    lora_alpha: float = opt(16.0, "LoRA alpha (the update is scaled by alpha / rank)", gt=0)
    lora_target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "names of the nn.Linear modules that get adapters ('all-linear': every Linear but the LM head)",
    )
    lora_dropout: float = opt(0.0, "dropout on the adapter input", ge=0, lt=1)
    lora_refit: str = opt(
        "auto",
        "what a LoRA refit ships: adapter (only the adapter, applied unmerged by the engines; launched SGLang "
        "engines get --enable-lora), merged (W + alpha/r * B@A under the base names); auto: adapter unless the "
        "engines are external (--rollout-external: miles cannot know they run with --enable-lora)",
        choices=("auto", "adapter", "merged"),
    )


@section
class EvalConfig:
    """Periodic evaluation."""

    eval_prompt_data: list[str] | None = opt(None, "pairs of NAME PATH, e.g. aime /data/aime.jsonl")
    eval_interval: int | None = opt(None, "evaluate every N rollouts (requires --eval-prompt-data)", ge=1)
    n_samples_per_eval_prompt: int = opt(1, "responses sampled per eval prompt", ge=1)
    eval_max_response_len: int = resolved("max new tokens in eval; None: --rollout-max-response-len", ge=1)
    eval_temperature: float = resolved("eval sampling temperature; None: --rollout-temperature", ge=0)
    eval_top_p: float = resolved("eval nucleus sampling threshold; None: --rollout-top-p", gt=0, le=1)
    eval_top_k: int = resolved("eval top-k; -1: disabled; None: --rollout-top-k", ge=-1)
    eval_input_key: str = resolved("eval dataset key holding the prompt; None: --input-key")
    eval_label_key: str | None = opt(
        None, "eval dataset key holding the label; None: --label-key", resolved=True
    )
    skip_eval_before_train: bool = opt(
        False, "do not evaluate before the first rollout (when eval is set up)"
    )
    eval_function_path: str = opt(
        "miles.rollout.default_rollout.eval_rollout", "eval function, 'module:function'"
    )

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        """`--eval-prompt-data` as (name, path) pairs; empty when unset."""
        items = self.eval_prompt_data or []
        return list(zip(items[0::2], items[1::2]))


@section
class LogConfig:
    """Metrics and logging."""

    use_wandb: bool = opt(False, "log metrics to Weights & Biases")
    use_tensorboard: bool = opt(False, "write TensorBoard event files to <run-dir>/tensorboard")
    progress: bool = opt(True, "progress bars for training and rollouts (only when stderr is a terminal)")
    wandb_project: str | None = opt(None, "wandb project")
    wandb_group: str | None = opt(None, "wandb group")
    wandb_key: str | None = opt(None, "wandb API key (default: $MILES_WANDB_KEY)", secret=True)
    wandb_mode: str | None = opt(None, "wandb mode", choices=("online", "offline", "disabled"))
    run_dir: str = resolved("output dir (metrics.jsonl, ...); None: runs/<UTC timestamp>")
    dump_details: str | None = opt(None, "directory to dump rollout and training details to")
    log_level: str = opt(
        "INFO",
        "level of miles's own log records (other libraries log from WARNING up; DEBUG: all)",
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    )


@section
class DebugConfig:
    """Replay debugging: save the rollouts, train from saved ones without engines, or only generate."""

    save_debug_rollout_data: str | None = opt(
        None, "save each rollout's samples to PATH (a {rollout_id} template, or a directory) as JSON lines"
    )
    load_debug_rollout_data: str | None = opt(
        None, "train on rollouts saved by --save-debug-rollout-data; no engines start, nothing is refit"
    )
    debug_rollout_only: bool = opt(
        False, "generate (and score, log, save) rollouts only: no training, no refit"
    )
    debug_train_only: bool = opt(False, "train only (requires --load-debug-rollout-data): no engines start")


# section attribute name on Config -> section class, in the order they print
SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "model": ModelConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "router": RouterConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "algo": AlgoConfig,
    "critic": CriticConfig,
    "lora": LoraConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "debug": DebugConfig,
}
