"""The workloads of `vs_trl.py`: model, tokenizer and prompts that miles and TRL both load, and the shared settings.

Three workloads (issue 10), all 16 prompts x 8 samples per step, one optimizer step per rollout:
- ``quickstart``: the README's tiny run (`scripts/run-tiny-cpu.sh`): the 97k-parameter Qwen3 of
  `miles.tools.tiny_model`, the echo task through the chat template, 2-token responses, lr 5e-3.
- ``compute``: a ~25M-parameter Qwen3 (hidden 512, 8 layers) with random weights; responses are exactly 64 tokens
  (the EOS logit is pinned far below the others, so no response ends early).
- ``varlen``: a ~3.2M-parameter Qwen3 (hidden 256, 4 layers) whose responses end at EOS after a number of tokens
  set by the prompt: lengths spread lognormal-like (median ~50) up to the 256-token limit; TRL pads, miles packs.

How a random model is made to stop on schedule (``eos_mode``), by editing weights only, so that any Qwen3 loader
(transformers, the embedded engine, the FSDP trainer) runs it unchanged. Three residual dimensions are reserved and
no layer writes to them (their rows in every ``o_proj`` and ``down_proj`` are zero):
- ``C`` holds a constant ``c`` (every token's embedding has it);
- ``K`` is 1-ish on *marker* tokens ('.') and 0 elsewhere;
- ``M`` receives, from head 0 of layer 0 (its query weights are zero, so it attends uniformly to the whole
  causal context, and its value reads ``K``), the fraction ``m`` of marker tokens in the context.
The output row of EOS reads only ``C`` and ``M``: its logit is ``b0 - kappa * m`` (``prompt_timed``), or a large
negative constant (``never``). Markers and the other special tokens get a large negative logit, so responses
never contain them. A prompt of ``L0`` echo tokens and ``n`` markers has ``m = n / (L0 + n + r)`` after ``r``
response tokens: EOS is improbable while ``m`` is high and likely once it has fallen to ~0.3, i.e. after
``r ~ 2.3 n - L0`` tokens. The marker counts are drawn lognormal per prompt, so the response lengths are too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

EOS_MODES = ("natural", "never", "prompt_timed")
MARKER = "."
# EOS logit (prompt_timed) is B0 - KAPPA * m, m = marker fraction of the context; others' logits are ~N(0, 0.5).
B0 = math.log(44.0) + 1.0
KAPPA = 10.0
SUPPRESS = 60.0  # logit offset that keeps markers and special tokens out of responses (and EOS, with "never")


@dataclass(frozen=True)
class Shared:
    """The experiment settings both systems get on every workload; `vs_trl.miles_command` and
    `trl_child.grpo_config_kwargs` both build their flags from these (one place, so they cannot drift apart)."""

    temperature: float = 1.0  # the policy's own distribution: no top-p, no top-k, no min-p
    top_p: float = 1.0
    eps_clip: float = 0.2  # PPO clip range, lower / upper
    eps_clip_high: float = 0.28
    clip_grad: float = 1.0  # max global gradient norm
    adam_beta1: float = 0.9  # AdamW as torch.optim.AdamW defaults it (miles' and transformers' defaults too)
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    skip_special_tokens: bool = True  # the reward reads the response text without special tokens, as TRL does


SHARED = Shared()

# Rows of the settings table `vs_trl` prints: each system reports its effective value of each (miles from its parsed
# config, TRL from the built trainer), as text in the same words, so equal text means the same setting.
SETTING_ROWS = (
    "prompts x samples per rollout",
    "samples per optimizer step",
    "optimizer steps per rollout",
    "micro-batch (samples)",
    "prompt format",
    "prompt order",
    "sampling",
    "max response tokens",
    "stop token ids",
    "reward text",
    "advantages",
    "policy loss",
    "KL",
    "optimizer",
    "grad clip",
    "lr schedule",
    "lr logged per step",
    "seed",
)
# Rows whose values need not agree: a seed feeds each system's own random streams, so equal numbers would not
# give equal samples anyway.
UNMATCHED_ROWS = frozenset({"seed"})


def sampling_text(
    temperature: float, top_p: float, top_k: int | None, min_p: float | None, repetition_penalty: float | None
) -> str:
    """The sampling settings in words; top-k <= 0 or None, top-p 1, min-p 0 or None, repetition penalty 1 or None
    are all "off" (the spellings of "disabled" differ between SGLang and transformers)."""
    parts = [f"temperature {temperature:g}"]
    parts.append(f"top-p {top_p:g}" if top_p < 1 else "top-p off")
    parts.append(f"top-k {top_k}" if top_k is not None and top_k > 0 else "top-k off")
    parts.append(f"min-p {min_p:g}" if min_p else "min-p off")
    rep = repetition_penalty
    parts.append(
        f"repetition penalty {rep:g}" if rep is not None and rep != 1.0 else "repetition penalty off"
    )
    return ", ".join(parts)


def optimizer_text(name: str, betas: tuple[float, float], eps: float, weight_decay: float) -> str:
    return f"{name} betas ({betas[0]:g}, {betas[1]:g}) eps {eps:g} weight decay {weight_decay:g}"


def lr_per_step_text(lrs: list[float]) -> str:
    """The learning rates a run logged, one per step: "5e-3 at all 40 steps", or the first, last and range."""
    vals = [v for v in lrs if v == v]
    if not vals:
        return "not logged"
    if len(set(vals)) == 1:
        return f"{vals[0]:g} at all {len(vals)} steps"
    return f"{vals[0]:g} first, {vals[-1]:g} last, {min(vals):g}-{max(vals):g} over {len(vals)} steps"


def settings_mismatches(miles: dict[str, str], trl: dict[str, str]) -> list[str]:
    """The rows of SETTING_ROWS (but UNMATCHED_ROWS) on which the two systems' effective settings differ."""
    return [k for k in SETTING_ROWS if k not in UNMATCHED_ROWS and miles.get(k) != trl.get(k)]


def format_settings(miles: dict[str, str], trl: dict[str, str], indent: str = "   ") -> list[str]:
    """The settings table: one line per row, the value once where both systems have it, both values and a mark
    where they differ."""
    differ = set(settings_mismatches(miles, trl))
    width = max(len(k) for k in SETTING_ROWS)
    lines = []
    for k in SETTING_ROWS:
        m, t = miles.get(k, "n/a"), trl.get(k, "n/a")
        text = f"{m} (both)" if m == t else f"miles {m} | TRL {t}" + ("  <-- DIFFERS" if k in differ else "")
        lines.append(f"{indent}{k:{width}}  {text}")
    return lines


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: model shape, prompts, sampling and optimizer settings (both systems use all)."""

    name: str
    description: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int | None  # None: 2 * hidden_size (miles.tools.tiny_model's default)
    tie_word_embeddings: bool
    eos_mode: str  # one of EOS_MODES
    chat: bool  # prompts as chat messages (the chat template is applied) or plain text
    max_response_len: int
    lr: float
    micro_batch_size: int  # samples per forward/backward; 128 / micro_batch_size accumulation steps in TRL
    steps: int  # optimizer steps = rollouts per run
    warmup_steps: int  # first steps left out of the steady-state numbers
    n_prompts: int = 16
    n_samples: int = 8
    marker_median: float = 25.0  # prompt_timed: median marker count per prompt (lognormal)
    marker_sigma: float = 0.6  # prompt_timed: sigma of log(marker count)

    def __post_init__(self) -> None:
        if self.eos_mode not in EOS_MODES:
            raise ValueError(f"workload {self.name}: eos_mode {self.eos_mode!r}; allowed {EOS_MODES}")
        if self.eos_mode != "natural" and self.tie_word_embeddings:
            raise ValueError(f"workload {self.name}: eos_mode {self.eos_mode!r} needs untied embeddings")
        if self.steps <= self.warmup_steps:
            raise ValueError(
                f"workload {self.name}: steps={self.steps} must exceed warmup_steps={self.warmup_steps}"
            )
        batch = self.n_prompts * self.n_samples
        if batch % self.micro_batch_size:
            raise ValueError(
                f"workload {self.name}: micro_batch_size={self.micro_batch_size} must divide {batch} samples"
            )

    @property
    def samples_per_step(self) -> int:
        """Samples (responses) per rollout = per optimizer step."""
        return self.n_prompts * self.n_samples

    def quick(self) -> Workload:
        """A shrunk copy for `--quick`: a smaller model where it is large, short responses, 3 steps."""
        return dataclasses.replace(
            self,
            hidden_size=min(self.hidden_size, 128),
            num_layers=min(self.num_layers, 2),
            num_heads=min(self.num_heads, 4),
            intermediate_size=None,
            max_response_len=min(self.max_response_len, 32 if self.eos_mode == "prompt_timed" else 8),
            marker_median=min(self.marker_median, 6.0),
            steps=3,
            warmup_steps=1,
        )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="quickstart",
            description="97k-param Qwen3, echo task via chat template, 2-token responses (run-tiny-cpu.sh)",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=None,
            tie_word_embeddings=True,
            eos_mode="natural",
            chat=True,
            max_response_len=2,
            lr=5e-3,
            micro_batch_size=32,
            # 12 steps with 2 of warm-up were too few: in the stop-20 report miles' steps 3-12 still fell, from
            # 0.33 to 0.19 s in one repeat and 0.24 to 0.17 s in the other, while TRL's stayed flat within noise;
            # 40 steps with 10 of warm-up measure both once their step times have settled (~5 s more per run)
            steps=40,
            warmup_steps=10,
        ),
        Workload(
            name="compute",
            description="25M-param Qwen3, random weights, exactly 64-token responses",
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            intermediate_size=1536,
            tie_word_embeddings=False,
            eos_mode="never",
            chat=False,
            max_response_len=64,
            lr=1e-5,
            micro_batch_size=32,
            steps=4,
            warmup_steps=1,
        ),
        Workload(
            name="varlen",
            description="3.2M-param Qwen3, responses end at EOS, lengths lognormal-like up to 256 tokens",
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            intermediate_size=768,
            tie_word_embeddings=False,
            eos_mode="prompt_timed",
            chat=False,
            max_response_len=256,
            lr=1e-5,
            micro_batch_size=32,
            steps=5,
            warmup_steps=1,
            marker_median=35.0,
            marker_sigma=0.75,
        ),
    )
}


def get_workload(name: str) -> Workload:
    """The workload called `name`; ValueError listing the known ones otherwise."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    return WORKLOADS[name]


# ------------------------------------------------------------------------------------------------ prompts
def marker_counts(n: int, median: float, sigma: float, seed: int, cap: int = 180) -> list[int]:
    """`n` marker counts, lognormal(log(median), sigma), rounded and clipped to [2, cap]."""
    rng = random.Random(seed)
    return [max(2, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def make_rows(w: Workload, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` dataset rows `{"prompt", "label"}` for workload `w`: echo prompts (`echo 3 3 3 3` -> label '3'), as
    chat messages when `w.chat`; with ``prompt_timed`` followed by a space and a per-prompt run of markers."""
    from miles.tools.toy_data import make_rows as echo_rows

    rows = echo_rows("echo", n, seed=seed, fmt="chat" if w.chat else "plain")
    if w.eos_mode == "prompt_timed":
        counts = marker_counts(n, w.marker_median, w.marker_sigma, seed + 1)
        for row, k in zip(rows, counts):
            row["prompt"] = f"{row['prompt']} {MARKER * k}"
    return rows


def write_rows(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write rows as JSONL atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ models
def build_model(w: Workload, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write workload `w`'s model + tokenizer (HF format) to `out_dir` (built aside, renamed into place).

    `eos_mode` "natural" keeps the random model's own EOS behaviour; the others design it (`schedule_eos`) on an
    untied model with a 1024-token context."""
    from miles.tools.tiny_model import build_tiny_model

    def designed_eos(model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast) -> None:
        markers = tok.convert_tokens_to_ids([MARKER])
        specials = [i for i in (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>")) if i is not None]
        schedule_eos(model, tok.eos_token_id, markers, specials, w.eos_mode)

    natural = w.eos_mode == "natural"
    return build_tiny_model(
        out_dir,
        task="echo",
        seed=seed,
        hidden_size=w.hidden_size,
        num_layers=w.num_layers,
        num_heads=w.num_heads,
        intermediate_size=w.intermediate_size,
        overwrite=True,
        tie_word_embeddings=natural,
        max_position_embeddings=512 if natural else 1024,
        edit_model=None if natural else designed_eos,
    )


def reserved_dims(hidden_size: int) -> tuple[int, int, int]:
    """Residual dimensions (C constant, M marker fraction, K marker flag) used by `schedule_eos`."""
    return hidden_size - 1, hidden_size - 2, hidden_size - 3


def schedule_eos(model: Any, eos_id: int, marker_ids: list[int], special_ids: list[int], mode: str) -> float:
    """Edit a random untied Qwen3 in place so that EOS follows `mode` (see the module docstring).

    Returns the measured RMS of the final hidden state, which scales the output rows.
    """
    import torch

    if mode not in ("never", "prompt_timed"):
        raise ValueError(f"schedule_eos mode {mode!r}; allowed 'never', 'prompt_timed'")
    cfg = model.config
    h, hd = cfg.hidden_size, cfg.head_dim
    dc, dm, dk = reserved_dims(h)
    layers = model.model.layers
    emb = model.model.embed_tokens.weight
    scale = float(emb.detach().std())  # typical embedding entry
    with torch.no_grad():
        emb[:, [dc, dm, dk]] = 0.0
        emb[:, dc] = scale
        emb[marker_ids, dk] = 2.0 * scale
        for layer in layers:
            layer.self_attn.o_proj.weight[[dc, dm, dk], :] = 0.0
            layer.mlp.down_proj.weight[[dc, dm, dk], :] = 0.0
        attn = layers[0].self_attn
        attn.q_proj.weight[:hd] = 0.0  # head 0: zero queries -> uniform attention over the causal context
        attn.v_proj.weight[0] = 0.0
        attn.v_proj.weight[0, dk] = 1.0  # its value component 0 reads the marker flag (after RMSNorm: ~2)
        attn.o_proj.weight[:, 0] = 0.0
        attn.o_proj.weight[dm, 0] = 0.5  # -> residual M = marker fraction of the context (~1 * m)
    rho = _final_rms(model)
    head = model.lm_head.weight
    with torch.no_grad():
        head[:, [dc, dm, dk]] = 0.0
        head[eos_id] = 0.0
        # logit = W . (x / rms(x)): a coefficient k on dim C adds k * scale / rho to the logit
        per_c = scale / rho
        if mode == "never":
            head[eos_id, dc] = -SUPPRESS / per_c
        else:
            head[eos_id, dc] = B0 / per_c
            head[eos_id, dm] = -KAPPA * rho  # M ~ m, so this adds -KAPPA * m
        for t in list(marker_ids) + list(special_ids):
            head[t] = 0.0
            head[t, dc] = -SUPPRESS / per_c
    return rho


def _final_rms(model: Any) -> float:
    """Median RMS of the input of the final norm over a few random sequences (what the output rows see)."""
    import torch

    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda mod, inp, out: captured.append(inp[0].detach()))
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (4, 48), generator=gen)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    x = captured[0]
    return float(x.pow(2).mean(-1).sqrt().median())
