"""Derived values: what validation fills in for flags left unset, and values derived from flags.

Each resolver reads the merged values (`miles.config.values.Values`) and sets what it derives; after them a
validated Config holds no None in a field declared `resolved` (`miles.config.sections.resolved`), so readers use
`cfg.eval.eval_temperature` as it is instead of picking between it and `--rollout-temperature` again.
"""

from __future__ import annotations

import json
import time

from miles.config.algo_names import default_policy_loss
from miles.config.schema import FIELDS, coerce
from miles.config.sections import derived_refit_timeout
from miles.config.values import Rule, Values

# flag left unset -> the flag whose value it takes
_FALLBACKS = (
    ("eps_clip_high", "eps_clip"),
    ("eval_temperature", "rollout_temperature"),
    ("eval_top_p", "rollout_top_p"),
    ("eval_top_k", "rollout_top_k"),
    ("eval_max_response_len", "rollout_max_response_len"),
    ("loss_reduction_constant", "rollout_max_response_len"),
    ("over_sampling_batch_size", "rollout_batch_size"),
    ("critic_lr", "lr"),
)
# dataset keys: unset or empty -> the training dataset's key
_KEY_FALLBACKS = (("eval_input_key", "input_key"), ("eval_label_key", "label_key"))


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
    for name, parent in _FALLBACKS:
        if v.values[name] is None and name not in v.bad and parent not in v.bad:
            value = v.values[parent]
            v.set_derived(name, float(value) if name == "loss_reduction_constant" else value)
    for name, parent in _KEY_FALLBACKS:
        if not v.values[name] and name not in v.bad and parent not in v.bad:
            v.set_derived(name, v.values[parent])


def _policy_loss(v: Values) -> None:
    if v.values["policy_loss"] is None and "policy_loss" not in v.bad:
        v.set_derived("policy_loss", default_policy_loss(v["advantage_estimator"]))


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


def _steps_per_rollout(v: Values) -> None:
    """`train.steps_per_rollout`: optimizer steps per rollout, when --global-batch-size divides the samples of a
    rollout (else `miles.config.rules` reports it)."""
    samples = v["rollout_batch_size"] * v["n_samples_per_prompt"]
    gbs = v["global_batch_size"]
    if gbs and samples % gbs == 0:
        v.set_derived("steps_per_rollout", samples // gbs)


def _lr_decay_iters(v: Values) -> None:
    if v["lr_decay_iters"] is not None:
        return
    steps = v.values.get("steps_per_rollout")
    if v["num_rollout"] is not None and steps is not None:
        v.set_derived("lr_decay_iters", v["num_rollout"] * steps)


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


def _lora_refit(v: Values) -> None:
    """--lora-refit auto: adapter unless the engines are external; adapter refits with launched SGLang engines
    need SGLang's LoRA flags (--enable-lora, --max-lora-rank, --lora-target-modules all: a superset of ours)."""
    if v["lora_rank"] == 0 or "sglang_args" in v.bad:
        return
    if v["lora_refit"] == "auto":
        v.set_derived("lora_refit", "merged" if v["rollout_external"] else "adapter")
    if v["lora_refit"] == "adapter" and not v["rollout_external"]:
        args = v.values["sglang_args"]
        args.setdefault("enable_lora", True)
        args.setdefault("max_lora_rank", str(v["lora_rank"]))
        args.setdefault("lora_target_modules", "all")


def fp8_quantization_config(scale_format: str) -> dict[str, object]:
    """The ``quantization_config`` of a block-FP8 checkpoint whose weights a `miles.refit.fp8` refit sends
    (what SGLang's Fp8Config reads from config.json; ``scale_fmt`` marks power-of-two scales)."""
    config: dict[str, object] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    if scale_format == "ue8m0":
        config["scale_fmt"] = "ue8m0"
    return config


def _rollout_quantization(v: Values) -> None:
    """--rollout-fp8-scale-format defaults to ue8m0 under DeepGEMM's MoE runner; with
    --rollout-weight-quantization fp8, launched SGLang engines get ``--quantization fp8`` and the FP8
    ``quantization_config`` by ``--json-model-override-args`` (SGLang builds block-FP8 layers only for a
    checkpoint that declares it); a pass-through flag that says otherwise is refused."""
    args = v.values["sglang_args"]
    if v.values["rollout_fp8_scale_format"] is None:
        fp8 = v.values["rollout_weight_quantization"] == "fp8"
        deep_gemm = fp8 and str(args.get("moe_runner_backend", "")) == "deep_gemm"
        v.set_derived("rollout_fp8_scale_format", "ue8m0" if deep_gemm else "float")
    if v.values["rollout_weight_quantization"] != "fp8" or "sglang_args" in v.bad:
        return
    quantization = str(args.get("quantization", "fp8"))
    if quantization != "fp8":
        v.fail(
            "rollout_weight_quantization",
            f"SGLang engines must load FP8 weights, but --sglang-quantization={quantization!r}: drop it or use fp8",
        )
        return
    override = args.get("json_model_override_args") or "{}"
    try:
        overrides = json.loads(str(override))
    except ValueError as e:
        v.fail("sglang_args", f"--sglang-json-model-override-args is not JSON: {e}")
        return
    wanted = fp8_quantization_config(v.values["rollout_fp8_scale_format"])
    if not isinstance(overrides, dict) or overrides.get("quantization_config", wanted) != wanted:
        v.fail(
            "rollout_weight_quantization",
            "sets the engines' quantization_config itself; drop quantization_config from "
            "--sglang-json-model-override-args",
        )
        return
    overrides["quantization_config"] = wanted  # (a resolved config read back holds it already)
    args["quantization"] = "fp8"
    args["json_model_override_args"] = json.dumps(overrides, separators=(",", ":"))


def _refit_timeout(v: Values) -> None:
    """--refit-timeout defaults below --train-timeout (derived from it): lowering one never trips the other."""
    if v.values["refit_timeout"] is None and "refit_timeout" not in v.bad:
        v.set_derived("refit_timeout", derived_refit_timeout(v["train_timeout"]))


RESOLVERS: list[Rule] = [
    _loss_reduction,
    _rollout_external,
    _fallbacks,
    _policy_loss,
    _rollout_gpus,
    _steps_per_rollout,
    _lr_decay_iters,
    _run_dir,
    _sglang_args,
    _lora_refit,
    _rollout_quantization,
    _refit_timeout,
]
