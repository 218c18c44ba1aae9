"""Build a tiny, randomly initialised Qwen3 model and a matching tokenizer for CPU tests and toy runs.

The tokenizer is a byte-level BPE trained locally (no hub access) on the toy task's corpus. Its alphabet is
only the characters of that corpus, so the vocabulary stays small (default 48 entries; every digit is its own
token) and a random policy samples a digit often enough to get a reward now and then. Characters outside the
corpus cannot be encoded (they are dropped). It carries the special tokens `<|im_start|>`, `<|im_end|>`
(eos) and `<|endoftext|>` (pad) and a Qwen-style chat template.

    python -m miles.tools.tiny_model --out /tmp/tiny --task echo --hidden-size 64 --num-layers 2 --seed 0

The output directory loads with `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` under `HF_HUB_OFFLINE=1`. The directory is built as `out.tmp` and
renamed into place, so a reader never sees a half-written model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles.tools.toy_data import DEFAULT_TASK, TASKS, tokenizer_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3Config

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(
    task: str = DEFAULT_TASK,
    vocab_size: int = 48,
    extra_texts: Sequence[str] = (),
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the corpus of toy task `task` and wrap it for transformers.

    `vocab_size` is the BPE target including the 3 special tokens and the corpus alphabet; it must be at least
    that large. Training is deterministic (same corpus, same merges). `extra_texts` join the corpus (their
    characters become encodable) and `extra_special_tokens` are whole tokens (e.g. tool-call markers).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = (*SPECIAL_TOKENS, *extra_special_tokens)
    texts = tokenizer_corpus(task) + list(extra_texts)
    for special in specials:  # special tokens are added whole; keep their characters out of the merges
        texts = [t.replace(special, "") for t in texts]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), min_frequency=1, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() > vocab_size:  # the trainer keeps the whole alphabet even past the target
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the corpus of task {task!r}: "
            f"the special tokens and alphabet alone need {tok.get_vocab_size()}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, *extra_special_tokens],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def _model_config(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int | None,
    initializer_range: float,
) -> Qwen3Config:
    from transformers import Qwen3Config

    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2 if num_heads % 2 == 0 else num_heads,  # GQA when it divides
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def _portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class and extra special tokens so that transformers 4.x loads the tokenizer too."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    elif extra is not None:
        cfg["extra_special_tokens"] = extra
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    task: str = DEFAULT_TASK,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int = 48,
    initializer_range: float = 0.02,
    overwrite: bool = False,
    extra_texts: Sequence[str] = (),
    extra_special_tokens: Sequence[str] = (),
) -> Path:
    """Write a tiny random Qwen3 model + tokenizer for toy task `task` to `out_dir` and return its path.

    Deterministic for a given seed and sizes. Built in `out_dir.tmp`, then renamed into place. An existing
    `out_dir` raises FileExistsError unless `overwrite`.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    tokenizer = build_tokenizer(task, vocab_size, extra_texts, extra_special_tokens)
    config = _model_config(
        tokenizer, hidden_size, num_layers, num_heads, intermediate_size, initializer_range
    )
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _portable_tokenizer_config(tmp / "tokenizer_config.json")
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m miles.tools.tiny_model --out DIR`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument(
        "--task", default=DEFAULT_TASK, choices=sorted(TASKS), help="toy task the tokenizer covers"
    )
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default 2 * hidden)")
    p.add_argument("--vocab-size", type=int, default=48, help="BPE vocabulary target (incl. special tokens)")
    p.add_argument("--initializer-range", type=float, default=0.02, help="std of the random init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    a = p.parse_args(argv)
    if Path(a.out).exists() and not a.overwrite:
        p.error(f"--out {a.out} already exists; pass --overwrite to replace it")
    out = build_tiny_model(
        a.out,
        task=a.task,
        seed=a.seed,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        initializer_range=a.initializer_range,
        overwrite=a.overwrite,
    )
    print(f"wrote tiny model for task {a.task!r} to {out}")


if __name__ == "__main__":
    main()
