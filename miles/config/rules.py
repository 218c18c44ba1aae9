"""Cross-field rules: each reads the merged, resolved values and records a violation per problem it finds.

Rules that need a package above the config (SGLang's and sglang-router's own parsers, the engines' address
format) live in `miles.preflight.server_flags`, which the driver's `parse_config` adds to these.
"""

from __future__ import annotations

import ipaddress
import re
from contextlib import suppress

from miles.config.async_rules import fully_async
from miles.config.ep_rules import expert_parallel
from miles.config.hybrid_rules import hybrid_models
from miles.config.schema import FIELDS
from miles.config.tp_rules import tensor_parallel
from miles.config.values import Rule, Skip, Values
from miles.config.vl_rules import vision_language
from miles.utils.parallel_dims import ParallelDims

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*(:|\.)[A-Za-z_]\w*$")


def _batch_sizes(v: Values) -> None:
    samples = v["rollout_batch_size"] * v["n_samples_per_prompt"]
    if samples % v["global_batch_size"]:
        v.fail(
            "global_batch_size",
            f"must divide --rollout-batch-size * --n-samples-per-prompt = {v['rollout_batch_size']} * "
            f"{v['n_samples_per_prompt']} = {samples} (samples per rollout)",
        )


def _parallelism(v: Values) -> None:
    world = v["actor_num_nodes"] * v["actor_num_gpus_per_node"]
    cp = v["context_parallel_size"]
    if world % cp:
        v.fail("context_parallel_size", f"must divide the actor world size {world} (nodes * gpus per node)")
        return
    tp = v["tensor_model_parallel_size"]
    if world % (cp * tp):
        v.fail(
            "tensor_model_parallel_size",
            f"must divide the actor world size {world} / --context-parallel-size {cp} (nodes * gpus per node)",
        )
        return
    dp = ParallelDims(world, cp, tp).dp_size
    with suppress(Skip):
        if v["rollout_batch_size"] % dp:
            v.fail(
                "rollout_batch_size",
                f"must be a multiple of the data-parallel size {dp}: each prompt group stays on one DP rank "
                "so that group-normalized advantages see the whole group",
            )
    if v["use_dynamic_batch_size"]:
        if v["max_tokens_per_gpu"] is None:
            v.missing("max_tokens_per_gpu", "with --use-dynamic-batch-size (token budget per micro-batch)")
        return
    gbs = v["global_batch_size"]
    if gbs % dp:
        v.fail(
            "global_batch_size",
            f"must be a multiple of the data-parallel size {dp} (world {world} / cp {cp}"
            + (f" / tp {tp})" if tp > 1 else ")"),
        )
    elif (gbs // dp) % v["micro_batch_size"]:
        v.fail(
            "micro_batch_size",
            f"must divide the per-rank batch {gbs // dp} (--global-batch-size {gbs} / data-parallel size {dp})",
        )


def _attention(v: Values) -> None:
    """Each --attn-implementation runs its own kernel; flash_attention_3 has none for context parallelism."""
    if v["attn_implementation"] == "flash_attention_3" and v["context_parallel_size"] > 1:
        v.fail(
            "attn_implementation",
            f"has no context-parallel kernel (--context-parallel-size={v['context_parallel_size']}): "
            "ring-flash-attn runs FlashAttention-2's kernels; use --attn-implementation flash_attention_2",
        )


def _rollout_placement(v: Values) -> None:
    if v["rollout_external"]:
        return  # _external_engines checks the engines miles does not launch
    world = v["actor_num_nodes"] * v["actor_num_gpus_per_node"]
    gpus = v["rollout_num_gpus"]
    if gpus is None:
        v.missing("rollout_num_gpus", "without --colocate (GPUs for the rollout engines)")
        return
    if v["colocate"] and gpus > world:
        v.fail("rollout_num_gpus", f"with --colocate must be <= the actor world size {world}")
    if gpus % v["rollout_num_gpus_per_engine"]:
        v.fail(
            "rollout_num_gpus",
            f"must be a multiple of --rollout-num-gpus-per-engine={v['rollout_num_gpus_per_engine']}",
        )


def _requires(v: Values) -> None:
    for name, needed, why in (
        ("save_interval", "save", "a directory to save to"),
        ("keep_last", "save", "a directory to save to"),
        ("save_hf_interval", "save_hf", "a directory to export to"),
        ("eval_interval", "eval_prompt_data", "eval datasets"),
    ):
        with suppress(Skip):
            if v[name] is not None and v[needed] is None:
                v.fail(name, f"requires {FIELDS[needed].flag} ({why})")
    with suppress(Skip):
        if v["use_wandb"] and v["wandb_project"] is None:
            v.fail("use_wandb", "requires --wandb-project")
    with suppress(Skip):
        if v["kl_loss_coef"] > 0 and not v["use_kl_loss"]:
            v.fail("kl_loss_coef", "has no effect without --use-kl-loss")


def _eval_data(v: Values) -> None:
    pairs = v["eval_prompt_data"]
    if pairs is None:
        return
    if not pairs or len(pairs) % 2:
        v.fail("eval_prompt_data", "expected pairs of NAME PATH (an even, non-zero number of items)")
        return
    names = pairs[0::2]
    if len(set(names)) != len(names):
        v.fail("eval_prompt_data", f"dataset names must be unique, got {names}")


def _algo(v: Values) -> None:
    with suppress(Skip):
        if v["tis_clip"] < v["tis_clip_low"]:
            v.fail("tis_clip", f"must be >= --tis-clip-low={v['tis_clip_low']}")
    with suppress(Skip):
        if v["mis_lower"] > v["mis_upper"]:
            v.fail("mis_lower", f"must be <= --mis-upper={v['mis_upper']}")
    with suppress(Skip):
        estimator = v["advantage_estimator"]
        if (
            v["kl_coef"] > 0
            and not estimator.startswith("reinforce_plus_plus")
            and not v["custom_advantage_function_path"]
        ):
            v.fail(
                "kl_coef",
                f"the KL reward penalty is applied by the reinforce_plus_plus estimators, not {estimator!r} "
                "(use --use-kl-loss --kl-loss-coef for a KL loss)",
            )
    with suppress(Skip):
        if v["use_rollout_logprobs"] and (v["use_tis"] or v["use_mis"] or v["custom_tis_function_path"]):
            v.fail(
                "use_rollout_logprobs",
                "already makes the PPO ratio relative to the rollout policy; --use-tis / --use-mis / "
                "--custom-tis-function-path would correct the same mismatch twice",
            )
    with suppress(Skip):
        if v["advantage_estimator"] == "rloo" and v["n_samples_per_prompt"] < 2:
            v.fail("advantage_estimator", "rloo needs --n-samples-per-prompt >= 2 (leave-one-out baseline)")


def _critic(v: Values) -> None:
    with suppress(Skip):
        if v["advantage_estimator"] != "ppo":
            for name in ("critic_load", "critic_lr", "num_critic_only_steps", "critic_lr_warmup_iters"):
                # --critic-lr equal to --lr is what an unset one resolves to (a --dry-run YAML read back)
                resolved_default = name == "critic_lr" and v[name] == v.values["lr"]
                if v.is_set(name) and v[name] not in (None, 0) and not resolved_default:
                    v.fail(name, "only applies to --advantage-estimator ppo (the critic)")
            return
        if v["custom_advantage_function_path"]:
            v.fail("custom_advantage_function_path", "--advantage-estimator ppo computes GAE from the critic")
        if v["num_rollout"] is not None and v["num_critic_only_steps"] >= v["num_rollout"]:
            v.fail(
                "num_critic_only_steps",
                f"must be < --num-rollout={v['num_rollout']} (the actor never trains)",
            )
        if v["train_backend"] != "fsdp":
            v.fail("advantage_estimator", "ppo needs a critic; only --train-backend fsdp has one")


def _lora(v: Values) -> None:
    with suppress(Skip):
        if v["lora_rank"] == 0:
            return
        if not v["lora_target_modules"]:
            v.fail("lora_target_modules", "must name at least one module with --lora-rank > 0")
        if v["ref_update_interval"] is not None:
            v.fail("ref_update_interval", "with --lora-rank the reference is the frozen base model")
        if v["ref_load"] is not None:
            v.fail(
                "ref_load",
                "with --lora-rank the reference is the frozen base (adapters off); a different reference "
                "would need a second copy of the weights",
            )


def _rollout_quantization(v: Values) -> None:
    if v["rollout_weight_quantization"] is None and v["rollout_fp8_scale_format"] != "float":
        v.fail("rollout_fp8_scale_format", "applies to FP8 rollout: add --rollout-weight-quantization fp8")


def _external_engines(v: Values) -> None:
    """--rollout-external-engine-addrs: given with --rollout-external; they take no local placement. (Each
    address's form is checked by `miles.preflight.server_flags`.)"""
    if not v["rollout_external"]:
        return
    addrs = v["rollout_external_engine_addrs"]
    if not addrs:
        v.missing(
            "rollout_external_engine_addrs", "with --rollout-external (HOST:PORT of each running engine)"
        )
        return
    with suppress(Skip):
        if v["colocate"]:
            v.fail(
                "colocate",
                "needs engines miles launches on the training devices; external engines "
                "(--rollout-external-engine-addrs) run on their own: drop --colocate",
            )
    with suppress(Skip):
        gpus, per_engine = v["rollout_num_gpus"], v["rollout_num_gpus_per_engine"]
        if gpus is not None and gpus != len(addrs) * per_engine:
            v.fail(
                "rollout_num_gpus",
                f"with external engines is only a check: {len(addrs)} engine(s) * "
                f"--rollout-num-gpus-per-engine={per_engine} = {len(addrs) * per_engine}; drop it or fix it",
            )
    with suppress(Skip):
        if v["load_debug_rollout_data"] is not None:
            v.fail(
                "rollout_external_engine_addrs", "conflicts with --load-debug-rollout-data (no engines run)"
            )


def _transfer_mode(v: Values) -> None:
    mode = v["update_weight_transfer_mode"]
    if mode == "broadcast" and v["colocate"]:
        v.fail(
            "update_weight_transfer_mode",
            "broadcast needs engines on devices of their own, but --colocate puts them on the training devices "
            "(NCCL cannot join two processes on one GPU); use tensor or auto",
        )
    if mode == "tensor" and not v["colocate"] and v["actor_num_nodes"] > 1:
        v.fail(
            "update_weight_transfer_mode",
            f"tensor handles reach only engines on the same node, but the trainers span --actor-num-nodes="
            f"{v['actor_num_nodes']} and the engines are not colocated; use broadcast or auto",
        )
    if mode == "tensor" and not v["colocate"] and not v["rollout_external_engine_addrs"]:
        ranks = v["actor_num_nodes"] * v["actor_num_gpus_per_node"]
        per_engine = v["rollout_num_gpus_per_engine"]
        engines = (v["rollout_num_gpus"] or 0) // per_engine
        if engines * per_engine > ranks:
            v.fail(
                "update_weight_transfer_mode",
                f"tensor handles give each of the {engines} engines {per_engine} training rank(s) of its own, but "
                f"there are {ranks}; use broadcast or auto (which broadcasts then)",
            )


def _update_weight_delta(v: Values) -> None:
    if v["update_weight_delta"] == "none":
        return
    if v["colocate"]:
        v.fail(
            "update_weight_delta",
            "a delta refit is for the broadcast transport, but --colocate refits through tensor handles or a "
            "shared weight window (nothing to save); use none",
        )
    elif v["update_weight_transfer_mode"] == "tensor":
        v.fail(
            "update_weight_delta",
            "a delta refit is for the broadcast transport, not --update-weight-transfer-mode tensor; use "
            "broadcast (or auto on GPU) or none",
        )


def _deadlines(v: Values) -> None:
    if v["refit_timeout"] >= v["train_timeout"]:
        v.fail(
            "refit_timeout",
            f"must be below --train-timeout ({v['train_timeout']:g}): the driver waits that long for a whole "
            "refit, and an engine call that hangs must expire first so that the error names the engine "
            "(unset, it defaults to min(300, --train-timeout / 2))",
        )


def _sampling(v: Values) -> None:
    if v["rollout_top_k"] == 0:
        v.fail("rollout_top_k", "must be -1 (disabled) or >= 1")


def _optim(v: Values) -> None:
    with suppress(Skip):
        if v["min_lr"] > v["lr"]:
            v.fail("min_lr", f"must be <= --lr={v['lr']}")
    with suppress(Skip):
        if v["lr_warmup_fraction"] is not None and v["lr_warmup_iters"] > 0:
            v.fail(
                "lr_warmup_fraction", f"conflicts with --lr-warmup-iters={v['lr_warmup_iters']}; set only one"
            )
    with suppress(Skip):
        decay = v["lr_decay_iters"]
        if decay is not None and v["lr_warmup_iters"] > decay:
            v.fail("lr_warmup_iters", f"must be <= --lr-decay-iters={decay}")


def is_loopback_host(host: str) -> bool:
    """Whether `host` names only this machine (`localhost`, 127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost


def _engine_access(v: Values) -> None:
    host = v["engine_host"]
    if not is_loopback_host(host) and not v["engine_api_key"]:
        v.fail(
            "engine_host",
            "is reachable from other machines, but no --engine-api-key is set: anyone on the network could "
            "update the engines' weights; set --engine-api-key or bind 127.0.0.1",
        )


_LOOPBACK_FIX = (
    "an engine bound there is unreachable from the other nodes (router, trainers' refit); set --engine-host "
    "0.0.0.0 (each engine then registers its node's address) with --engine-api-key"
)


def _multi_node_engine_host(v: Values) -> None:
    """A run over several nodes needs engines the other nodes can reach: a loopback --engine-host is refused.

    Here: --actor-num-nodes > 1. Engines placed on several machines by Ray are refused at start-up by
    `loopback_engine_host_problem` (the placement is known only then)."""
    if v["rollout_external"] or not is_loopback_host(v["engine_host"]):
        return
    nodes = v["actor_num_nodes"]
    if nodes > 1:
        v.fail(
            "engine_host",
            f"is a loopback address, but --actor-num-nodes={nodes} spreads the run over several nodes: "
            + _LOOPBACK_FIX,
        )


def loopback_engine_host_problem(engine_host: str, machine_addresses: set[str]) -> str | None:
    """The problem with a loopback `--engine-host` when the run's placement spans `machine_addresses` (the
    addresses of the nodes holding its trainers and engines; simulated nodes of one machine share one), or None."""
    if not is_loopback_host(engine_host) or len(machine_addresses) <= 1:
        return None
    return (
        f"--engine-host={engine_host!r} is a loopback address, but Ray placed the trainers and engines on "
        f"{len(machine_addresses)} machines ({', '.join(sorted(machine_addresses))}): " + _LOOPBACK_FIX
    )


_SEAM_PATHS = (
    "rollout_function_path",
    "eval_function_path",
    "dynamic_sampling_filter_path",
    "generate_execute_tool_function_path",
    "agent_function_path",
    "session_sample_picker_path",
    "session_sample_postprocessor_path",
)


def _function_paths(v: Values) -> None:
    for name in FIELDS:
        if (name.startswith("custom_") and name.endswith("_path")) or name in _SEAM_PATHS:
            with suppress(Skip):
                if v[name] is not None and not _FUNCTION_PATH.match(v[name]):
                    v.fail(name, "expected 'module.path:function' (or 'module.path.function')")


def _rollout_seams(v: Values) -> None:
    """Cross-field rules of the rollout flags (dynamic sampling, partial rollout, multi-turn, rewards)."""
    with suppress(Skip):
        if v["mask_offpolicy_in_partial_rollout"] and not v["partial_rollout"]:
            v.fail("mask_offpolicy_in_partial_rollout", "has no effect without --partial-rollout")
    with suppress(Skip):
        if v["generate_execute_tool_function_path"] and not v["custom_generate_function_path"]:
            v.fail(
                "generate_execute_tool_function_path",
                "is used by a multi-turn generate function; add --custom-generate-function-path "
                "miles.rollout.multi_turn.generate_multi_turn",
            )
    with suppress(Skip):
        rm_type = v["rm_type"] or ""
        if (
            rm_type.removeprefix("boxed_") == "dapo"
            and not v["reward_key"]
            and not v["custom_reward_post_process_path"]
        ):
            v.fail("rm_type", "dapo rewards are dicts {score, acc}: add --reward-key score")
        if rm_type.removeprefix("boxed_") == "remote_rm" and not v["rm_url"]:
            v.fail("rm_type", "remote_rm needs --rm-url (the reward service's URL)")
    with suppress(Skip):
        url = v["rm_url"]
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            v.fail("rm_url", "expected an http(s):// URL, e.g. http://127.0.0.1:8001/reward")
    with suppress(Skip):
        if v["group_rm"] and not v["custom_rm_path"]:
            v.fail("group_rm", "calls --custom-rm-path once per prompt group; set --custom-rm-path")
    with suppress(Skip):
        if v["eval_top_k"] == 0 and v.is_set("eval_top_k"):  # derived from --rollout-top-k: reported there
            v.fail("eval_top_k", "must be -1 (disabled) or >= 1")


# flags the first slice of the session server does not combine with (issue 26): refused, never ignored
_SESSION_SERVER_CONFLICTS = {
    "custom_generate_function_path": "the session server is the generate function",
    "generate_execute_tool_function_path": "the agent runs its own tools",
    "partial_rollout": "an agent episode cannot be continued in the next rollout yet",
}


def _session_server(v: Values) -> None:
    """--use-session-server needs --agent-function-path (and the reverse); see _SESSION_SERVER_CONFLICTS."""
    with suppress(Skip):
        on, agent = v["use_session_server"], v["agent_function_path"]
        if agent and not on:
            v.fail("agent_function_path", "runs against the session server; add --use-session-server")
        for hook in ("session_sample_picker_path", "session_sample_postprocessor_path"):
            with suppress(Skip):
                if v[hook] and not on:
                    v.fail(hook, "picks the session server's samples; add --use-session-server")
        if not on:
            return
        if not agent:
            v.fail("use_session_server", "needs --agent-function-path (async def run(base_url, sample, ctx))")
        for name, why in _SESSION_SERVER_CONFLICTS.items():
            with suppress(Skip):
                if v[name]:
                    v.fail(name, f"is not supported with --use-session-server: {why}")


def _debug(v: Values) -> None:
    """Replay debugging: train from saved rollouts (no engines) or generate only (no trainer), not both."""
    with suppress(Skip):
        load, rollout_only = v["load_debug_rollout_data"], v["debug_rollout_only"]
        if v["debug_train_only"] and load is None:
            v.fail("debug_train_only", "requires --load-debug-rollout-data (the rollouts to train on)")
        if load is not None and rollout_only:
            v.fail("debug_rollout_only", "conflicts with --load-debug-rollout-data (no engines would run)")
        if load is not None and v["save_debug_rollout_data"] is not None:
            v.fail(
                "save_debug_rollout_data", "conflicts with --load-debug-rollout-data (nothing is generated)"
            )
        if load is not None and v["eval_interval"] is not None:
            v.fail("eval_interval", "needs engines, which --load-debug-rollout-data does not start")
        if rollout_only:
            for name in ("save", "save_hf"):
                if v[name] is not None:
                    v.fail(name, "has nothing to save with --debug-rollout-only (no trainer)")


RULES: list[Rule] = [
    _debug,
    _batch_sizes,
    _parallelism,
    _attention,
    _rollout_placement,
    _requires,
    _eval_data,
    _algo,
    _critic,
    tensor_parallel,
    expert_parallel,
    _lora,
    _rollout_quantization,
    _external_engines,
    _transfer_mode,
    _update_weight_delta,
    _deadlines,
    _sampling,
    _optim,
    _engine_access,
    _multi_node_engine_host,
    _function_paths,
    _rollout_seams,
    _session_server,
    fully_async,
    vision_language,
    hybrid_models,
]
