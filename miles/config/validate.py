"""Resolve derived values and collect every violation, on the merged (not yet frozen) values.

Order: per-field type/choices/bounds/required -> derived values -> cross-field rules. A field that failed an
earlier check is "bad": later rules that read it are skipped, so one mistake yields one message.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from miles.config.schema import FIELDS, check_field, coerce
from miles.config.sections import derived_refit_timeout
from miles.utils.parallel_dims import ParallelDims

DEFAULT = "default"
CLI = "command line"
DERIVED = "derived"

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*(:|\.)[A-Za-z_]\w*$")


class _Skip(Exception):
    """A rule read a field that already has a violation."""


class Values:
    """Merged raw values with their sources, the set of bad fields and the violations found so far."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str]) -> None:
        self.values = values
        self.sources = sources
        self.bad: set[str] = set()
        self.violations: list[str] = []

    def __getitem__(self, name: str) -> Any:
        if name in self.bad:
            raise _Skip(name)
        return self.values[name]

    def set_derived(self, name: str, value: object) -> None:
        self.values[name] = value
        self.sources[name] = DERIVED

    def is_set(self, name: str) -> bool:
        """Whether the value came from the user (CLI, YAML or a dict), not a default or a derivation."""
        return self.sources[name] not in (DEFAULT, DERIVED)

    def describe(self, name: str) -> str:
        """`--flag=value`, plus where the value came from unless that was the command line."""
        text = f"{FIELDS[name].flag}={self.values[name]!r}"
        source = self.sources[name]
        return text if source == CLI else f"{text} [{source}]"

    def missing(self, name: str, why: str) -> None:
        self.violations.append(f"{FIELDS[name].flag} is required {why}")
        self.bad.add(name)

    def fail(self, name: str, problem: str) -> None:
        self.violations.append(f"{self.describe(name)}: {problem}")
        self.bad.add(name)


def check_fields(v: Values) -> None:
    """Coerce each value to its declared type, then check choices, bounds and `required`."""
    for name, spec in FIELDS.items():
        try:
            v.values[name] = coerce(spec, v.values[name])
        except ValueError as e:
            v.fail(name, str(e))
            continue
        try:
            problem = check_field(spec, v.values[name])
        except ImportError as e:  # the allowed values come from a package that is not installed
            problem = f"cannot be checked: {e}"
        if problem:
            v.fail(name, problem)
        elif spec.meta("required") and v.values[name] is None:
            v.missing(name, f"(pass {spec.flag} or set it in the --config YAML)")


def _run(v: Values, rules: list[Callable[[Values], None]]) -> None:
    for rule in rules:
        with suppress(_Skip):
            rule(v)


# ---- derived values ---------------------------------------------------------------------------------


def _loss_reduction(v: Values) -> None:
    if v["calculate_per_token_loss"]:
        if v.is_set("loss_reduction") and v["loss_reduction"] != "token_mean":
            v.fail(
                "loss_reduction",
                "conflicts with --calculate-per-token-loss (which means token_mean); drop one of them",
            )
            return
        v.set_derived("loss_reduction", "token_mean")
    if v["loss_reduction"] == "token_mean" and not v.values["calculate_per_token_loss"]:
        v.set_derived("calculate_per_token_loss", True)


def _fallbacks(v: Values) -> None:
    for name, parent in (
        ("eps_clip_high", "eps_clip"),
        ("eval_temperature", "rollout_temperature"),
        ("eval_max_response_len", "rollout_max_response_len"),
        ("loss_reduction_constant", "rollout_max_response_len"),
    ):
        if v.values[name] is None and name not in v.bad and parent not in v.bad:
            value = v.values[parent]
            v.set_derived(name, float(value) if name == "loss_reduction_constant" else value)


def _rollout_external(v: Values) -> None:
    if v["rollout_external_engine_addrs"] is not None and not v["rollout_external"]:
        if v.is_set("rollout_external"):
            v.fail("rollout_external", "conflicts with --rollout-external-engine-addrs (which implies it)")
            return
        v.set_derived("rollout_external", True)


def _rollout_gpus(v: Values) -> None:
    if v["rollout_external"]:
        return
    if v["rollout_num_gpus"] is None and v["colocate"]:
        v.set_derived("rollout_num_gpus", v["actor_num_nodes"] * v["actor_num_gpus_per_node"])


def _lr_decay_iters(v: Values) -> None:
    if v["lr_decay_iters"] is not None:
        return
    samples = v["rollout_batch_size"] * v["n_samples_per_prompt"]
    gbs = v["global_batch_size"]
    if v["num_rollout"] is not None and gbs and samples % gbs == 0:
        v.set_derived("lr_decay_iters", v["num_rollout"] * (samples // gbs))


def _run_dir(v: Values) -> None:
    if v["run_dir"] is None:
        v.set_derived("run_dir", "runs/" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))


def _sglang_args(v: Values) -> None:
    """Keep declared `--sglang-*` fields and `sglang_args` consistent; a declared field wins when set. Keys are
    SGLang's option names with underscores."""
    args = {key.lstrip("-").replace("-", "_"): value for key, value in v["sglang_args"].items()}
    for name, spec in FIELDS.items():
        if spec.section != "engine" or not name.startswith("sglang_") or name == "sglang_args":
            continue
        key = name[len("sglang_") :]
        if v[name] is not None:
            args[key] = str(v[name])
        elif key in args:
            try:
                v.set_derived(name, coerce(spec, args[key]))
            except ValueError as e:
                v.violations.append(f"sglang_args[{key!r}]={args[key]!r}: {e}")
                v.bad.add("sglang_args")
                return
    v.values["sglang_args"] = args


def _refit_timeout(v: Values) -> None:
    """--refit-timeout defaults below --train-timeout (derived from it): lowering one never trips the other."""
    if v.values["refit_timeout"] is None and "refit_timeout" not in v.bad:
        v.set_derived("refit_timeout", derived_refit_timeout(v["train_timeout"]))


RESOLVERS: list[Callable[[Values], None]] = [
    _loss_reduction,
    _rollout_external,
    _fallbacks,
    _rollout_gpus,
    _lr_decay_iters,
    _run_dir,
    _sglang_args,
    _refit_timeout,
]


# ---- cross-field rules --------------------------------------------------------------------------------


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
    dp = ParallelDims(world, cp).dp_size
    with suppress(_Skip):
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
            f"must be a multiple of the data-parallel size {dp} (world {world} / cp {cp})",
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
        with suppress(_Skip):
            if v[name] is not None and v[needed] is None:
                v.fail(name, f"requires {FIELDS[needed].flag} ({why})")
    with suppress(_Skip):
        if v["use_wandb"] and v["wandb_project"] is None:
            v.fail("use_wandb", "requires --wandb-project")
    with suppress(_Skip):
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
    with suppress(_Skip):
        if v["tis_clip"] < v["tis_clip_low"]:
            v.fail("tis_clip", f"must be >= --tis-clip-low={v['tis_clip_low']}")
    with suppress(_Skip):
        if v["mis_lower"] > v["mis_upper"]:
            v.fail("mis_lower", f"must be <= --mis-upper={v['mis_upper']}")
    with suppress(_Skip):
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
    with suppress(_Skip):
        if v["use_rollout_logprobs"] and (v["use_tis"] or v["use_mis"] or v["custom_tis_function_path"]):
            v.fail(
                "use_rollout_logprobs",
                "already makes the PPO ratio relative to the rollout policy; --use-tis / --use-mis / "
                "--custom-tis-function-path would correct the same mismatch twice",
            )
    with suppress(_Skip):
        if v["advantage_estimator"] == "rloo" and v["n_samples_per_prompt"] < 2:
            v.fail("advantage_estimator", "rloo needs --n-samples-per-prompt >= 2 (leave-one-out baseline)")


def _critic(v: Values) -> None:
    with suppress(_Skip):
        if v["advantage_estimator"] != "ppo":
            for name in ("critic_load", "critic_lr", "num_critic_only_steps", "critic_lr_warmup_iters"):
                if v.is_set(name) and v[name] not in (None, 0):
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
    with suppress(_Skip):
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


def _engine(v: Values) -> None:
    if v["check_weight_update_equal"] and v["rollout_num_gpus_per_engine"] > 1:
        v.fail(
            "check_weight_update_equal",
            f"compares whole tensors, but engines with --rollout-num-gpus-per-engine="
            f"{v['rollout_num_gpus_per_engine']} hold tensor-parallel shards; use 1 GPU per engine or drop it",
        )


def _external_engines(v: Values) -> None:
    """--rollout-external-engine-addrs: well-formed HOST:PORT, each once; they take no local placement."""
    if not v["rollout_external"]:
        return
    addrs = v["rollout_external_engine_addrs"]
    if not addrs:
        v.missing(
            "rollout_external_engine_addrs", "with --rollout-external (HOST:PORT of each running engine)"
        )
        return
    from miles.engines.external import engine_url

    try:
        urls = [engine_url(a) for a in addrs]
        if len(set(urls)) != len(urls):
            v.fail("rollout_external_engine_addrs", "names an engine twice")
    except ValueError as e:
        v.fail("rollout_external_engine_addrs", str(e))
    with suppress(_Skip):
        if v["colocate"]:
            v.fail(
                "colocate",
                "needs engines miles launches on the training devices; external engines "
                "(--rollout-external-engine-addrs) run on their own: drop --colocate",
            )
    with suppress(_Skip):
        gpus, per_engine = v["rollout_num_gpus"], v["rollout_num_gpus_per_engine"]
        if gpus is not None and gpus != len(addrs) * per_engine:
            v.fail(
                "rollout_num_gpus",
                f"with external engines is only a check: {len(addrs)} engine(s) * "
                f"--rollout-num-gpus-per-engine={per_engine} = {len(addrs) * per_engine}; drop it or fix it",
            )
    with suppress(_Skip):
        if v["load_debug_rollout_data"] is not None:
            v.fail(
                "rollout_external_engine_addrs", "conflicts with --load-debug-rollout-data (no engines run)"
            )


def _router(v: Values) -> None:
    """--router-* pass-through flags (checked with sglang-router's own parser) and an external router."""
    with suppress(_Skip):
        from miles.engines.router_args import router_arg_problems

        args = v["router_args"]
        for given, problem in router_arg_problems(args):
            v.violations.append(f"{given}: {problem}")
            v.bad.add("router_args")
    ip, port = v["sglang_router_ip"], v["sglang_router_port"]
    if (ip is None) != (port is None):
        missing = "sglang_router_port" if port is None else "sglang_router_ip"
        v.missing(
            missing, "to use a running sglang-router (give --sglang-router-ip and --sglang-router-port)"
        )
        return
    if ip is None:
        return
    if v["router_args"]:
        from miles.engines.router_args import flag_of

        flags = ", ".join(flag_of(name) for name in v["router_args"])
        v.violations.append(
            f"{flags}: configure a router miles launches; the running router at "
            "--sglang-router-ip/--sglang-router-port keeps its own options: drop them"
        )
        v.bad.add("router_args")
    if v["router_policy"] is not None:
        v.fail(
            "router_policy",
            "the running router at --sglang-router-ip/--sglang-router-port keeps its own policy: drop it",
        )


def _sglang_passthrough(v: Values) -> None:
    """--sglang-* flags that miles sets itself (refused with the reason, SGLang installed or not)."""
    from miles.engines.sglang_args import owned_problems

    for given, problem in owned_problems(v["sglang_args"]):
        v.violations.append(f"{given}: {problem}")
        v.bad.add("sglang_args")


def check_sglang_flags(v: Values) -> None:
    """Every `--sglang-*` flag through SGLang's own parser, launched as miles launches it: a bad name or value
    is a violation naming the flag and quoting SGLang. Only where SGLang is installed and flags were given
    (SGLang's server arguments import torch), and not for engines miles does not launch with them (`--rollout-engine
    local`, external engines)."""
    from miles.engines.sglang_args import parser_problems, sglang_installed

    with suppress(_Skip):
        # v.values: also when a miles-owned flag made it bad (the others are still checked)
        args = v.values["sglang_args"]
        if not args or v["rollout_engine"] == "local" or v["rollout_external"] or not sglang_installed():
            return
        for given, problem in parser_problems(args):
            v.violations.append(f"{given}: {problem}")
            v.bad.add("sglang_args")


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
    with suppress(_Skip):
        if v["min_lr"] > v["lr"]:
            v.fail("min_lr", f"must be <= --lr={v['lr']}")
    with suppress(_Skip):
        if v["lr_warmup_fraction"] is not None and v["lr_warmup_iters"] > 0:
            v.fail(
                "lr_warmup_fraction", f"conflicts with --lr-warmup-iters={v['lr_warmup_iters']}; set only one"
            )
    with suppress(_Skip):
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
)


def _function_paths(v: Values) -> None:
    for name in FIELDS:
        if (name.startswith("custom_") and name.endswith("_path")) or name in _SEAM_PATHS:
            with suppress(_Skip):
                if v[name] is not None and not _FUNCTION_PATH.match(v[name]):
                    v.fail(name, "expected 'module.path:function' (or 'module.path.function')")


def _rollout_seams(v: Values) -> None:
    """Cross-field rules of the rollout flags (dynamic sampling, partial rollout, multi-turn, rewards)."""
    with suppress(_Skip):
        if v["mask_offpolicy_in_partial_rollout"] and not v["partial_rollout"]:
            v.fail("mask_offpolicy_in_partial_rollout", "has no effect without --partial-rollout")
    with suppress(_Skip):
        if v["generate_execute_tool_function_path"] and not v["custom_generate_function_path"]:
            v.fail(
                "generate_execute_tool_function_path",
                "is used by a multi-turn generate function; add --custom-generate-function-path "
                "miles.rollout.multi_turn.generate_multi_turn",
            )
    with suppress(_Skip):
        rm_type = v["rm_type"] or ""
        if (
            rm_type.removeprefix("boxed_") == "dapo"
            and not v["reward_key"]
            and not v["custom_reward_post_process_path"]
        ):
            v.fail("rm_type", "dapo rewards are dicts {score, acc}: add --reward-key score")
        if rm_type.removeprefix("boxed_") == "remote_rm" and not v["rm_url"]:
            v.fail("rm_type", "remote_rm needs --rm-url (the reward service's URL)")
    with suppress(_Skip):
        url = v["rm_url"]
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            v.fail("rm_url", "expected an http(s):// URL, e.g. http://127.0.0.1:8001/reward")
    with suppress(_Skip):
        if v["group_rm"] and not v["custom_rm_path"]:
            v.fail("group_rm", "calls --custom-rm-path once per prompt group; set --custom-rm-path")
    with suppress(_Skip):
        if v["eval_top_k"] == 0:
            v.fail("eval_top_k", "must be -1 (disabled) or >= 1")


def _debug(v: Values) -> None:
    """Replay debugging: train from saved rollouts (no engines) or generate only (no trainer), not both."""
    with suppress(_Skip):
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


RULES: list[Callable[[Values], None]] = [
    _debug,
    _batch_sizes,
    _parallelism,
    _attention,
    _rollout_placement,
    _requires,
    _eval_data,
    _algo,
    _critic,
    _lora,
    _engine,
    _external_engines,
    _router,
    _sglang_passthrough,
    _transfer_mode,
    _deadlines,
    _sampling,
    _optim,
    _engine_access,
    _multi_node_engine_host,
    _function_paths,
    _rollout_seams,
]


def resolve_and_validate(v: Values, server_parsers: bool = False) -> None:
    """Run every check and derivation on `v` in place; violations accumulate in `v.violations`.

    `server_parsers`: also `check_sglang_flags` (SGLang's parser). `parse_config` asks for it, where a run's
    configuration is first read (`--dry-run` included); `Config.from_dict`, which rebuilds it inside the Ray
    actors (trainers among them), does not, so SGLang is never imported into a training process."""
    check_fields(v)
    _run(v, RESOLVERS)
    _run(v, RULES)
    if server_parsers:
        check_sglang_flags(v)
