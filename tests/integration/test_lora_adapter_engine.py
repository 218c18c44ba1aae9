"""Adapter-only LoRA refit (--lora-refit adapter): the embedded engine, a real HTTP server on a tiny Qwen3, loads
a PEFT adapter written by the trainer's refit code and applies it unmerged to the requests that name it.

- the adapter is applied: log-probs with and without it differ, and with it they equal the trainer's LoRA model
  (`LoRALinear`, fp32) within 1e-5; requests without `lora_path` in the same batch stay the base model's;
- the engine's endpoints follow SGLang's (`/load_lora_adapter`, `/unload_lora_adapter`, `GET /v1/models`);
- bytes per refit, merged vs adapter-only, on the e2e LoRA model (tiny Qwen3 at hidden 256, rank 8, all-linear).
"""

from __future__ import annotations

import pytest
import torch

from miles.algo.logprobs import compute_log_probs
from miles.backends.fsdp_utils.lora import (
    MergedView,
    adapter_config,
    adapters_disabled,
    apply_lora,
    gathered_adapters,
)
from miles.engines.sglang_engine import EngineHTTPError, EngineProcess
from miles.refit.lora_adapter import (
    adapter_bytes,
    adapter_name,
    adapter_names_in,
    newest_adapter,
    write_adapter,
)
from miles.tools.tiny_model import build_tiny_model, build_word_model

PROMPTS = [[3, 5, 7], [10, 11, 12, 13, 14, 15, 16], [20, 21]]


def lora_model(model_dir, rank: int, seed: int = 0) -> torch.nn.Module:
    """The trainer's LoRA model (fp32) with adapters moved away from B = 0, so they change the outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    apply_lora(model, rank, 16.0, ["all-linear"], 0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    model_dir = build_word_model(root / "model")
    model = lora_model(model_dir, rank=4)
    config = adapter_config(model, 4, 16.0, 0.0, str(model_dir))
    path = write_adapter(str(root / "adapters"), adapter_name("1"), gathered_adapters(model), dict(config))
    eng = EngineProcess(
        str(model_dir), kind="local", local_args={"num-threads": 1, "max-running-requests": 8}
    )
    with eng:
        yield eng, model, path


def generate(engine, prompts, lora_path, seed=0):
    sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}
    batch = isinstance(prompts[0], list)
    body = {
        "input_ids": prompts,
        "sampling_params": [sp] * len(prompts) if batch else sp,
        "return_logprob": True,
        "lora_path": lora_path,
    }
    return engine.post("/generate", body, timeout=60)


def trainer_log_probs(model, prompt, ids, adapter: bool) -> torch.Tensor:
    with torch.no_grad():
        if adapter:
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
        else:
            with adapters_disabled(model):
                logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    return compute_log_probs(logits[len(prompt) - 1 : -1], torch.tensor(ids), 1.0)


def engine_log_probs(out) -> tuple[list[int], torch.Tensor]:
    lp = out["meta_info"]["output_token_logprobs"]
    return out["output_ids"], torch.tensor([x for x, _, _ in lp])


def test_adapter_is_applied_unmerged_and_matches_the_trainer(setup):
    engine, model, path = setup
    name = adapter_name("1")
    with pytest.raises(EngineHTTPError, match="not a loaded LoRA adapter"):
        generate(engine, PROMPTS[:1], name)
    answer = engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert answer["success"] and answer["loaded_adapters"] == {name: path}
    assert newest_adapter(adapter_names_in(engine.get("/v1/models"))) == name

    # one batch: every prompt with the adapter, then every prompt without (the base rows share the forward)
    outs = generate(engine, PROMPTS * 2, [name] * len(PROMPTS) + [None] * len(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        ids, got = engine_log_probs(outs[i])
        assert torch.allclose(got, trainer_log_probs(model, prompt, ids, adapter=True), atol=1e-5, rtol=0)
        # the adapter matters: the base model gives these tokens other log-probs
        assert (got - trainer_log_probs(model, prompt, ids, adapter=False)).abs().max() > 1e-3
        base_ids, base = engine_log_probs(outs[len(PROMPTS) + i])
        assert torch.allclose(
            base, trainer_log_probs(model, prompt, base_ids, adapter=False), atol=1e-5, rtol=0
        )

    # a single request names the adapter as a plain string
    ids, got = engine_log_probs(generate(engine, PROMPTS[1], name, seed=3))
    assert torch.allclose(got, trainer_log_probs(model, PROMPTS[1], ids, adapter=True), atol=1e-5, rtol=0)

    with pytest.raises(EngineHTTPError, match="already loaded"):
        engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert engine.post("/unload_lora_adapter", {"lora_name": name})["loaded_adapters"] == {}
    assert adapter_names_in(engine.get("/v1/models")) == []
    with pytest.raises(EngineHTTPError, match="not a loaded LoRA adapter"):
        generate(engine, PROMPTS[:1], name)
    with pytest.raises(EngineHTTPError, match="is not loaded"):
        engine.post("/unload_lora_adapter", {"lora_name": name})


def test_load_refuses_a_bad_directory(setup, tmp_path):
    engine, _, _ = setup
    with pytest.raises(EngineHTTPError, match="no adapter_config.json"):
        engine.post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})


def test_adapter_refit_ships_over_ten_times_fewer_bytes(tmp_path, capsys):
    """Bytes of tensor data per refit on the e2e LoRA model (tests/e2e/test_lora_e2e.py: hidden 256, rank 8,
    all-linear, fp32): merged (every weight of MergedView) vs adapter-only (lora_A and lora_B)."""
    model_dir = build_tiny_model(tmp_path / "model", task="echo", seed=0, hidden_size=256)
    model = lora_model(model_dir, rank=8)
    merged = sum(t.numel() * t.dtype.itemsize for t in MergedView(model).state_dict().values())
    adapter = adapter_bytes(gathered_adapters(model))
    with capsys.disabled():
        print(f"\nrefit bytes, tiny LoRA model (hidden 256, rank 8, all-linear, fp32): merged {merged}, "
              f"adapter {adapter} ({merged / adapter:.1f}x fewer)")  # fmt: skip
    assert merged >= 10 * adapter, (merged, adapter)


def test_newest_adapter_picks_the_highest_version():
    assert newest_adapter(["base", adapter_name("9"), adapter_name("10"), "miles-lora-vx"]) == adapter_name(
        "10"
    )
    assert newest_adapter(["base"]) is None
    models = {"data": [{"id": "m", "root": "m"}, {"id": "a", "root": "/p", "parent": "m"}]}
    assert adapter_names_in(models) == ["a"]
