"""Forward a packed batch through an HF causal LM and read off per-response-token log-probs and entropy."""

from __future__ import annotations

import torch

from miles.algo.logprobs import log_probs_and_entropy
from miles.backends.fsdp_utils.attention import use_flash_kernel
from miles.backends.fsdp_utils.context_parallel import CPContext, CPShard, all_gather_autograd, shard_for_cp
from miles.backends.fsdp_utils.data_packing import PackedBatch, unpack_sequences
from miles.backends.fsdp_utils.packed_attention import enable_varlen_attention, padded_layout

__all__ = ["forward_packed", "forward_values"]


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def forward_packed(
    model: torch.nn.Module,
    packed: PackedBatch,
    temperature: float,
    cp: CPContext | None = None,
    with_entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Log-probs (and optionally entropy) of every response token of every sequence in `packed`.

    Runs `model` (an HF causal LM, plain or FSDP2-wrapped) on the packed row with "miles_varlen" attention
    (switched on here if needed), `use_cache=False`. The logits at row position t predict token t+1, so
    response token j of sequence i (row position cu_seqlens[i] + prompt_length_i + j) is scored from the
    logits one position earlier, always inside the same sequence. Only those rows go through the LM head
    (`logits_to_keep`), and `log_probs_and_entropy` reads log-probs and entropy off them in row chunks (the same
    numbers as `compute_log_probs` / `compute_entropy`: fp32, temperature-scaled) without [T, V] float32 copies.
    Differentiable with respect to the model parameters.

    With `cp` (size > 1) the row is padded and split across the CP group (see context_parallel.py); every CP
    rank must call this with the same pack and gets the same full results.

    Returns (log_probs, entropy): lists over the pack's sequences (order of `packed.sample_indices`) of
    [response_length_i] float32 tensors; entropy is None unless `with_entropy`.
    """
    out, tokens, positions, shard = _run_packed(model, packed, cp, "forward_packed")
    if shard is None:  # out: [R, V] at the scored rows
        log_probs, entropy = log_probs_and_entropy(
            out, tokens.index_select(0, positions + 1), temperature, with_entropy
        )
    else:  # out: [C, V], this CP rank's rows
        local_lp, local_ent = log_probs_and_entropy(out, shard.local_next_tokens(), temperature, with_entropy)
        log_probs = all_gather_autograd(local_lp, shard.cp).index_select(0, positions)  # [T_pad] -> [R]
        entropy = None
        if local_ent is not None:
            entropy = all_gather_autograd(local_ent, shard.cp).index_select(0, positions)

    lp_list = unpack_sequences(log_probs, packed)
    ent_list = unpack_sequences(entropy, packed) if entropy is not None else None
    return lp_list, ent_list


def forward_values(
    model: torch.nn.Module, packed: PackedBatch, cp: CPContext | None = None
) -> list[torch.Tensor]:
    """Critic values of every response token of every sequence in `packed`: the value head's output (a [.., 1]
    "LM head", see miles.backends.fsdp_utils.critic) at the row positions whose logits `forward_packed` scores,
    i.e. V(s_t) is read where the policy's distribution over response token t is read. Same packing, CP split
    and attention as `forward_packed`; differentiable. Returns [response_length_i] float32 per sequence."""
    out, _, positions, shard = _run_packed(model, packed, cp, "forward_values")
    values = out[:, 0].float()  # [R] at the scored rows, or [C] local rows under CP
    if shard is not None:
        values = all_gather_autograd(values, shard.cp).index_select(0, positions)
    return unpack_sequences(values, packed)


def _run_packed(
    model: torch.nn.Module, packed: PackedBatch, cp: CPContext | None, caller: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CPShard | None]:
    """The model on the packed row, "miles_varlen" attention, no cache: (head output, tokens, scored row positions,
    CP shard). Without CP (shard None) the head runs only on the scored rows (`logits_to_keep`): output [R, H];
    with CP the row is split across the group and the output is this rank's [C, H] rows."""
    if packed.num_sequences == 0:
        raise ValueError(f"{caller} got an empty pack (no sequences)")
    enable_varlen_attention(model)
    device = _model_device(model)
    tokens = packed.tokens.to(device)
    positions = packed.logit_positions().to(device)  # [R] rows whose logits predict response tokens
    if cp is None or cp.size == 1:
        cu = packed.cu_seqlens.to(device)
        max_len = packed.max_seqlen
        # the SDPA kernel's padded layout depends only on the boundaries: built once here, not once per layer
        layout = None if use_flash_kernel(tokens) else padded_layout(packed.cu_seqlens.tolist(), device)
        out = model(
            input_ids=tokens[None],
            position_ids=packed.position_ids.to(device)[None],
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
            logits_to_keep=positions,  # the head runs on the R scored rows only, not on the whole row
            miles_layout=layout,
        )
        return out.logits[0], tokens, positions, None
    shard = shard_for_cp(tokens, packed.position_ids.to(device), packed.cu_seqlens.to(device), cp)
    out = model(
        input_ids=shard.local_tokens[None],
        position_ids=shard.local_position_ids[None],
        use_cache=False,
        miles_cp=shard,
    )
    return out.logits[0], tokens, positions, shard
