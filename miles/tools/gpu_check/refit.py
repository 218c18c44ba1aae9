"""Check 2: refit of miles's embedded engine, running as its own server process on the check's device, from the
trainer through tensor handles (CUDA IPC on a GPU, shared memory on CPU) with miles's refit bucket code; then a
short generation whose log-probs must match the trainer's forward.

The engine starts from a checkpoint of another seed, so before the refit its weights and samples disagree with
the trainer's; the numbers of that state are reported beside the ones after the refit (what the check would
see if a refit were lost).
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import torch

from miles.tools.gpu_check.common import POWER, CheckResult, Settings, sync
from miles.utils.engine_control_http import request

if TYPE_CHECKING:
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.engines.sglang_engine import EngineProcess

VERSION = "gpu-check-1"


def launch_engine(s: Settings, model_dir: str) -> EngineProcess:
    """`python -m miles.engines.local --device ... --dtype ...` on `model_dir`; returns the EngineProcess."""
    from miles.engines.sglang_engine import EngineProcess

    local_args: dict[str, object] = {"device": str(s.device), "dtype": s.dtype_name, "random-seed": s.seed,
                                  "max-running-requests": max(1, s.gen_prompts)}  # fmt: skip
    if s.device.type == "cpu":
        local_args["num-threads"] = 1
    log = str(s.workdir / "engine.log")
    return EngineProcess(
        model_dir, kind="local", local_args=local_args, log_path=log, startup_timeout=900
    ).launch()


def _trainer_checksums(model: torch.nn.Module, s: Settings) -> tuple[dict[str, str], int]:
    """Checksums of the tensors a refit sends (HF names, the engine dtype) and their total bytes."""
    from miles.refit.buckets import iter_weight_buckets
    from miles.utils.weight_checksum import device_hash_kind, tensor_checksum

    sums, nbytes = {}, 0
    for bucket in iter_weight_buckets(model, s.bucket_bytes, s.dtype):
        for name, t in bucket:
            sums[name] = tensor_checksum(t, device_hash_kind(s.device))  # the engine's hash on its device
            nbytes += t.numel() * t.element_size()
    return sums, nbytes


def _engine_checksums(url: str) -> dict[str, str]:
    from miles.refit.engine_endpoints import engine_checksums

    return engine_checksums(url, {}, 600.0, VERSION)[0]  # the embedded engine: one rank


def _handle_uuid(s: Settings) -> str | None:
    """On CUDA: the device's UUID when a tensor handle made by miles's serializer carries it (SGLang's rule: a
    local device index names another GPU in a process with other visible devices), else None."""
    if s.device.type != "cuda":
        return None
    import base64

    from miles.utils.serialization import serialize, share_named_tensors

    payload = base64.b64decode(serialize(share_named_tensors([("probe", torch.ones(4, device=s.device))])))
    uuid = str(torch.cuda.get_device_properties(s.device).uuid)
    return uuid if uuid.encode() in payload else None


def generate_and_compare(trainer: FSDPTrainer, url: str, s: Settings) -> dict[str, float]:
    """Sample `gen_prompts` x `gen_tokens` tokens from the engine (log-probs on), score the same tokens with the
    trainer's packed forward at the same temperature; returns mean and max |Δ log-prob| and the token count."""
    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.forward import forward_packed

    rng = random.Random(s.seed + 1)
    prompts = [
        [rng.randrange(3, s.preset.vocab_size) for _ in range(8 + 4 * i)] for i in range(s.gen_prompts)
    ]
    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": s.temperature, "max_new_tokens": s.gen_tokens, "ignore_eos": True},
        "return_logprob": True,
    }
    resp = request("POST", url, "generate", "gpu check generation", 600.0, body=body)
    rows, engine_lp = [], []
    for prompt, out in zip(prompts, resp.response.json()):
        ids = [int(x) for x in out["output_ids"]]
        rows.append({"tokens": prompt + ids, "response_length": len(ids)})
        engine_lp.append([float(e[0]) for e in out["meta_info"]["output_token_logprobs"]])
    (packed,) = pack_sequences(rows, num_packs=1)
    with torch.no_grad():
        trainer_lp, _ = forward_packed(trainer.model, packed, s.temperature)
    diffs = torch.cat([
        (lp.float().cpu() - torch.tensor(engine_lp[i])).abs()
        for lp, i in zip(trainer_lp, packed.sample_indices.tolist())
    ])  # fmt: skip
    return {"mean": float(diffs.mean()), "max": float(diffs.max()), "tokens": int(diffs.numel())}


def check_refit(trainer: FSDPTrainer, url: str, s: Settings) -> CheckResult:
    """Refit with `ColocatedWeightUpdater` (timed), then every tensor's checksum on both sides."""
    from miles.refit.session import RefitSetup
    from miles.refit.tensor_handles import ColocatedWeightUpdater

    trainer_sums, nbytes = _trainer_checksums(trainer.model, s)
    before = _engine_checksums(url)
    differed = sum(before.get(n) != c for n, c in trainer_sums.items())
    updater = ColocatedWeightUpdater(RefitSetup([url], 1, 0, 1, timeout_s=600.0))
    sync(s.device)
    t0 = time.perf_counter()
    buckets = updater.update(trainer.model, s.bucket_bytes, VERSION, dtype=s.dtype)
    sync(s.device)
    seconds = time.perf_counter() - t0
    after = _engine_checksums(url)
    equal = sum(after.get(n) == c for n, c in trainer_sums.items())
    gb = nbytes / 1e9
    size = f"{gb:.3f} GB" if gb >= 0.1 else f"{nbytes / 1e6:.3f} MB"
    uuid = _handle_uuid(s)
    uuid_ok = s.device.type != "cuda" or uuid is not None
    numbers = {"tensors": len(trainer_sums), "bit_equal": equal, "differed_before": differed, "bytes": nbytes,
               "buckets": buckets, "seconds": seconds, "seconds_per_gb": seconds / gb, "device_uuid": uuid}  # fmt: skip
    passed = equal == len(trainer_sums) and uuid_ok
    handles = "shared-memory handles" if s.device.type == "cpu" else (
        f"CUDA IPC handles carry device UUID {uuid}" if uuid else "CUDA IPC handles carry NO device UUID"
    )  # fmt: skip
    summary = (
        f"{size} ({s.dtype_name}, {buckets} bucket(s)) in {seconds:.3f} s = {seconds / gb:.2f} s/GB; "
        f"{equal}/{len(trainer_sums)} tensors bit-equal after (differed before: {differed}); {handles}"
    )
    return CheckResult("refit", passed, summary, numbers)


def check_generation(before: dict[str, float], after: dict[str, float], s: Settings) -> CheckResult:
    """After the refit the engine's log-probs must match the trainer's within the tolerance, and before it
    they must not (else this check could not see a wrong weight)."""
    tol = s.tolerances
    sensitive = before["mean"] >= POWER * tol.gen_mean
    passed = after["mean"] <= tol.gen_mean and after["max"] <= tol.gen_max and sensitive
    numbers: dict[str, float | int | str | None] = {"tokens": after["tokens"], "mean_abs_diff": after["mean"], "max_abs_diff": after["max"],
               "before_refit_mean_abs_diff": before["mean"], "tolerance_mean": tol.gen_mean,
               "tolerance_max": tol.gen_max}  # fmt: skip
    summary = (
        f"{s.gen_prompts} x {s.gen_tokens} tokens at T={s.temperature}: engine vs trainer |Δ log-prob| mean "
        f"{after['mean']:.3g} (tolerance {tol.gen_mean:g}), max {after['max']:.3g} (tolerance {tol.gen_max:g}); "
        f"before the refit mean {before['mean']:.3g}"
        + ("" if sensitive else f" (< {POWER:g} x the tolerance: this model could not show a wrong weight)")
    )
    return CheckResult("generation", passed, summary, numbers)
