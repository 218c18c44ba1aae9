"""Packing benchmark on CPU: training tokens/s packed vs padded, and pack balance of Karmarkar-Karp vs first-fit.

    python scripts/bench/packing.py [--num-samples 64] [--max-tokens 2048] [--micro-batch-size 8]

Same tiny random Qwen3, same lognormal-length data, one forward+backward pass over all samples each way:
- padded: consecutive micro-batches of `--micro-batch-size` samples, right-padded to the longest, HF sdpa with
  an attention mask;
- packed: `pack_sequences` under `--max-tokens`, `forward_packed` (miles_varlen attention).
Tokens/s counts real (non-pad) tokens. Balance: max/mean tokens per pack over the same number of packs.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from miles.algo.logprobs import compute_log_probs  # noqa: E402
from miles.backends.fsdp_utils.data_packing import pack_sequences  # noqa: E402
from miles.backends.fsdp_utils.forward import forward_packed  # noqa: E402
from miles.tools.tiny_model import tiny_config, tiny_model  # noqa: E402
from miles.utils.seqlen_balancing import (  # noqa: E402
    first_fit_decreasing,
    get_minimum_num_micro_batch_size,
    partition_to_packs,
)

VOCAB = 256


def make_samples(n: int, seed: int, max_len: int) -> list[dict]:
    """Prompts of 16-64 tokens, responses lognormal (median ~150 tokens, sigma 1), total capped at max_len."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(16, 64)
        resp = max(1, min(max_len - prompt, int(rng.lognormvariate(5.0, 1.0))))
        out.append({"tokens": [rng.randrange(VOCAB) for _ in range(prompt + resp)], "response_length": resp})
    return out


def make_model() -> Qwen3ForCausalLM:
    # hidden 64, head_dim 16
    cfg = tiny_config(VOCAB, max_position_embeddings=4096, tie_word_embeddings=False)
    model = tiny_model(cfg, seed=0)
    model.set_attn_implementation("sdpa")
    return model


def run_padded(model: Qwen3ForCausalLM, samples: list[dict], mbs: int) -> float:
    """Seconds for forward+backward of all samples in right-padded micro-batches."""
    model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    for b in range(0, len(samples), mbs):
        batch = samples[b : b + mbs]
        width = max(len(s["tokens"]) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s["tokens"])] = torch.tensor(s["tokens"])
            mask[i, : len(s["tokens"])] = 1
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = 0.0
        for i, s in enumerate(batch):
            n, r = len(s["tokens"]), s["response_length"]
            loss = loss + compute_log_probs(logits[i, n - r - 1 : n - 1], ids[i, n - r : n]).sum()
        loss.backward()
    return time.perf_counter() - start


def run_packed(model: Qwen3ForCausalLM, samples: list[dict], max_tokens: int) -> tuple[float, int]:
    """Seconds for forward+backward of all samples packed under max_tokens; and the number of packs."""
    start = time.perf_counter()
    packs = pack_sequences(samples, max_tokens_per_pack=max_tokens)
    for p in packs:
        lps, _ = forward_packed(model, p, 1.0)
        sum(lp.sum() for lp in lps).backward()
    return time.perf_counter() - start, len(packs)


def balance(lengths: list[int], cap: int) -> tuple[int, float, float]:
    """(packs, KK max/mean, first-fit max/mean) with both using first-fit's pack count under `cap`.

    KK here is `partition_to_packs`, what `pack_sequences` uses: Karmarkar-Karp, repaired if it overflows.
    """
    ff = first_fit_decreasing(lengths, cap)
    k = get_minimum_num_micro_batch_size(lengths, cap)
    kk = partition_to_packs(lengths, k, cap)

    def ratio(parts: list[list[int]]) -> float:
        loads = [sum(lengths[i] for i in p) for p in parts]
        return max(loads) / (sum(loads) / len(loads))

    return k, ratio(kk), ratio(ff)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2048, help="max tokens per pack")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="samples per padded micro-batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    samples = make_samples(args.num_samples, args.seed, args.max_tokens)
    lengths = [len(s["tokens"]) for s in samples]
    total = sum(lengths)
    print(f"{len(samples)} samples, {total} tokens, mean {total / len(samples):.0f}, max {max(lengths)}")

    model = make_model()
    run_padded(model, samples[:4], 4)  # warm-up both paths
    run_packed(model, samples[:4], args.max_tokens)
    model.zero_grad(set_to_none=True)
    t_pad = run_padded(model, samples, args.micro_batch_size)
    model.zero_grad(set_to_none=True)
    t_pack, n_packs = run_packed(model, samples, args.max_tokens)
    print(f"padded: {total / t_pad:8.0f} tokens/s ({t_pad:.2f}s, micro-batch size {args.micro_batch_size})")
    print(
        f"packed: {total / t_pack:8.0f} tokens/s ({t_pack:.2f}s, {n_packs} packs <= {args.max_tokens} tokens)"
    )
    print(f"packed/padded throughput: {t_pad / t_pack:.2f}x")

    for n, cap in [(64, 4096), (256, 4096), (256, 8192)]:
        lens = [len(s["tokens"]) for s in make_samples(n, args.seed + 1, cap)]
        k, kk, ff = balance(lens, cap)
        print(f"balance n={n} cap={cap} packs={k}: KK max/mean {kk:.4f}, first-fit max/mean {ff:.4f}")


if __name__ == "__main__":
    main()
