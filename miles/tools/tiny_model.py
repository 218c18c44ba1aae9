"""The one builder of tiny, randomly initialised Qwen3 models and their tokenizers (CPU tests, toy runs, benches).

Pieces, each usable alone: `tiny_config` (the Qwen3 config), `tiny_model` (the seeded model in memory),
`build_tokenizer` (byte-level BPE for a toy task) and `word_tokenizer` (whitespace words), and `build_tiny_model`,
which writes a model and a tokenizer of either kind to disk (`build_word_model`: the engine tests' preset of it).

The BPE tokenizer is a byte-level BPE trained locally (no hub access) on the toy task's corpus. Its alphabet is
only the characters of that corpus, so the vocabulary stays small (default 48 entries; every digit is its own
token) and a random policy samples a digit often enough to get a reward now and then. Characters outside the
corpus cannot be encoded (they are dropped). It carries the special tokens `<|im_start|>`, `<|im_end|>`
(eos) and `<|endoftext|>` (pad) and a Qwen-style chat template. The word-level tokenizer (`tokenizer="words"`)
maps `<pad>`, `<unk>`, `<eos>` and then a fixed list of English words to ids in order, for engine tests that
want readable text and a fixed vocabulary.

    python -m miles.tools.tiny_model --out /tmp/tiny --task echo --hidden-size 64 --num-layers 2 --seed 0

The output directory loads with `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` under `HF_HUB_OFFLINE=1`. The directory is built as `out.tmp` and
renamed into place, so a reader never sees a half-written model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from miles.tools.toy_data import DEFAULT_TASK, TASKS, tokenizer_corpus

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

TokenizerKind = Literal["bpe", "words"]
TOKENIZER_KINDS: tuple[str, ...] = get_args(TokenizerKind)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A compact template in the shape of Qwen3's: tools listed in the system turn, an assistant's tool calls as
# <tool_call>{json}</tool_call>, tool answers as a user turn in <tool_response>.
QWEN3_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORD_SPECIALS = ("<pad>", "<unk>", "<eos>")  # ids 0, 1, 2 of a word-level tokenizer
WORDS = (
    "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "home", "is", "big", "small", "red",
    "blue", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "yes", "no", "stop",
    "go", "up", "down", "left", "right", "in", "out", "hello", "world", "answer", "question", ".", ",", "!", "?",
)  # fmt: skip


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


def word_tokenizer(words: Sequence[str] = WORDS) -> PreTrainedTokenizerFast:
    """A whitespace-split word-level tokenizer: `<pad>`, `<unk>`, `<eos>` (ids 0-2), then `words` in order.

    An unknown word encodes as `<unk>`; the vocabulary has exactly `3 + len(words)` entries.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*WORD_SPECIALS, *words))}
    if len(vocab) != len(WORD_SPECIALS) + len(words):
        raise ValueError(f"word_tokenizer: the words repeat or collide with the specials {WORD_SPECIALS}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def tiny_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.02,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen3Config:
    """The float32 Qwen3 config of a tiny model (no BOS token).

    Defaults: `num_kv_heads` = heads / 2 when that divides (GQA), else `num_heads`; `head_dim` = hidden / heads;
    `intermediate_size` = 2 * hidden.
    """
    from transformers import Qwen3Config

    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        head_dim = hidden_size // num_heads
    if num_kv_heads is None:
        num_kv_heads = num_heads // 2 if num_heads % 2 == 0 else num_heads
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def tiny_model(
    config: Qwen3Config,
    seed: int,
    device: torch.device | None = None,
    matrix_std: float | None = None,
) -> Qwen3ForCausalLM:
    """A float32 Qwen3ForCausalLM of `config`, initialised right after `torch.manual_seed(seed)`.

    Leaves torch's global RNG where the init left it (callers that must not see that wrap the call in
    `torch.random.fork_rng`). `device`: where the weights are initialised (a GPU is fast for big presets).
    `matrix_std`: when set, every weight matrix is redrawn from N(0, matrix_std) after the HF init, which makes the
    logits sharper than the default init, so sampling from the random model is not near-uniform.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = Qwen3ForCausalLM(config).float()
    if matrix_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, matrix_std)
    return model


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


def save_model_dir(
    model: Any, tok: PreTrainedTokenizerFast, out: Path, extra: Callable[[Path], None] | None = None
) -> None:
    """Save `model` and `tok` as the HF directory `out`: written in `out.tmp`, then put in place of any old `out`
    (which is removed only once the new one is there), so a failure never leaves a half-written directory. The
    generation config gets the tokenizer's EOS and pad ids; `extra(tmp)` writes any further files (e.g. a VL
    model's processor files) before the swap."""
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _portable_tokenizer_config(tmp / "tokenizer_config.json")
    if extra is not None:
        extra(tmp)
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


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
    *,
    tokenizer: TokenizerKind = "bpe",
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    matrix_std: float | None = None,
    edit_model: Callable[[Qwen3ForCausalLM, PreTrainedTokenizerFast], None] | None = None,
) -> Path:
    """Write a tiny random Qwen3 model + tokenizer to `out_dir` and return its path.

    `tokenizer="bpe"`: the BPE tokenizer of toy task `task` (`vocab_size`, `extra_texts`, `extra_special_tokens`
    shape it); `"words"`: the word-level tokenizer over `WORDS` (those three do not apply). Deterministic for a
    given seed and sizes; torch's global RNG is left as it was. Built in `out_dir.tmp`, then renamed into place.
    An existing non-empty `out_dir` raises FileExistsError unless `overwrite`. `edit_model(model, tokenizer)`, when
    given, changes the random model in place before it is written (a bench's designed EOS behaviour).
    """
    import torch

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    if tokenizer == "bpe":
        tok = build_tokenizer(task, vocab_size, extra_texts, extra_special_tokens)
    elif tokenizer == "words":
        if extra_texts or extra_special_tokens:
            raise ValueError(
                "extra_texts and extra_special_tokens apply to tokenizer='bpe' only, not 'words'"
            )
        tok = word_tokenizer()
    else:
        raise ValueError(f"tokenizer={tokenizer!r}; expected one of {TOKENIZER_KINDS}")
    config = tiny_config(
        len(tok),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        model = tiny_model(config, seed, matrix_std=matrix_std)
        if edit_model is not None:  # sees the RNG as the init left it
            edit_model(model, tok)
    save_model_dir(model, tok, out)
    return out


def build_word_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    *,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
) -> Path:
    """The engine tests' model: hidden 32, 2 layers, 4 heads / 2 KV heads, the word-level tokenizer, and weight
    matrices drawn from N(0, 0.3) so that sampling is far from uniform. Written as `build_tiny_model` writes."""
    return build_tiny_model(
        out_dir,
        seed=seed,
        hidden_size=32,
        tokenizer="words",
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        matrix_std=0.3,
    )


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
    p.add_argument(
        "--tokenizer", default="bpe", choices=TOKENIZER_KINDS, help="BPE of the toy task, or whitespace words"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    a = p.parse_args(argv)
    if Path(a.out).exists() and any(Path(a.out).iterdir()) and not a.overwrite:
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
        tokenizer=a.tokenizer,
    )
    print(f"wrote tiny model ({a.tokenizer} tokenizer) to {out}")


if __name__ == "__main__":
    main()
