"""Turn a miles DCP checkpoint into a HuggingFace model directory.

    python -m miles.tools.convert_to_hf --checkpoint runs/x/ckpt/iter_0000059 --out runs/x/hf [--dtype bfloat16]

`--checkpoint` is one `iter_N` directory or a `--save` directory (its newest checkpoint). The output holds
safetensors shards with an index, config.json, generation_config.json and the tokenizer, and loads with
`AutoModelForCausalLM.from_pretrained(out)`, SGLang or the embedded engine. The directory is built beside
`--out` and renamed into place. Runs in one process on CPU; memory stays within one output shard.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from miles.tools._cli import console_script, run_tool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m miles.tools.convert_to_hf",
        description="Convert a miles DCP checkpoint (written by --save) into a HuggingFace model directory.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="an iter_N checkpoint directory, or a --save directory"
    )
    p.add_argument("--out", required=True, help="output HF directory (built atomically)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weight dtype; auto: the checkpoint's training dtype",
    )
    p.add_argument(
        "--hf-checkpoint",
        default=None,
        help="HF dir the run started from; needed only for checkpoints without an hf/ subdirectory",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 5GB, 500MB)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument(
        "--lora-export",
        default=None,
        choices=("merged", "adapter"),
        help="LoRA checkpoints only: the merged model (default) or the adapter alone (peft layout); with "
        "merged, --hf-checkpoint overrides the base model named in the checkpoint",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from miles.backends.fsdp_utils.hf_export import (
        convert_checkpoint,
        dtype_from_name,
        parse_size,
        resolve_dcp_checkpoint,
    )
    from miles.backends.fsdp_utils.lora_export import convert_lora_checkpoint, is_lora_checkpoint

    def work() -> Path:
        dtype = None if args.dtype == "auto" else dtype_from_name(args.dtype)
        max_shard_bytes = parse_size(args.max_shard_size)
        iter_dir = resolve_dcp_checkpoint(args.checkpoint)
        if iter_dir is not None and is_lora_checkpoint(iter_dir):
            return convert_lora_checkpoint(
                iter_dir,
                args.out,
                args.lora_export or "merged",
                dtype=dtype,
                base=args.hf_checkpoint,
                max_shard_bytes=max_shard_bytes,
                overwrite=args.overwrite,
            )
        if args.lora_export is not None:
            raise ValueError(
                f"--lora-export: {args.checkpoint} is not a LoRA checkpoint (it holds no adapters)"
            )
        return convert_checkpoint(
            args.checkpoint,
            args.out,
            dtype=dtype,
            hf_source=args.hf_checkpoint,
            max_shard_bytes=max_shard_bytes,
            overwrite=args.overwrite,
        )

    return run_tool("convert_to_hf", work)


def cli() -> None:
    """The console script."""
    console_script(main)


if __name__ == "__main__":
    cli()
