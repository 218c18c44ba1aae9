"""`python -m miles.engines.local --model-path DIR [--host 127.0.0.1] [--port N] ...`: run the embedded engine."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

# The keys travel by environment, never on the command line (/proc/<pid>/cmdline is world-readable).
from miles.engines.sglang_launch import ADMIN_API_KEY_ENV, API_KEY_ENV

if TYPE_CHECKING:
    from miles.engines.local.engine import LocalEngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the server flags (names follow `sglang.launch_server` where they overlap)."""
    p = argparse.ArgumentParser(prog="python -m miles.engines.local", description=__doc__)
    p.add_argument("--model-path", required=True, help="HF model directory (config, weights, tokenizer)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --api-key")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"as SGLang: required on every endpoint but /health* (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--admin-api-key",
        default=os.environ.get(ADMIN_API_KEY_ENV) or None,
        help=f"as SGLang: required on the admin endpoints (refit, memory, ...) (default: ${ADMIN_API_KEY_ENV})",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="torch device of the model: cpu, cuda or cuda:N")
    p.add_argument("--max-running-requests", type=int, default=64, help="requests decoded together at most")
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV token budget (prompt + max_new_tokens)"
    )
    p.add_argument(
        "--context-length", type=int, default=None, help="max prompt + new tokens (default: the model's)"
    )
    p.add_argument(
        "--chunked-prefill-size", type=int, default=8192, help="prompt tokens per forward pass; -1: unlimited"
    )
    p.add_argument(
        "--random-seed", type=int, default=0, help="with the request id, seeds each request's sampler"
    )
    p.add_argument("--weight-version", default="default", help="initial weight version reported")
    p.add_argument(
        "--update-group-timeout",
        type=float,
        default=30.0,
        help="seconds /init_weights_update_group waits for its peers before failing",
    )
    p.add_argument(
        "--cpu-packed-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU float32: multiply large projections by oneDNN-packed copies of the weights (faster decode and "
        "prefill; one more copy of those weights in memory)",
    )
    p.add_argument(
        "--trim-after-release",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the process's free heap pages back to the OS after /release_memory_occupation (glibc "
        "malloc_trim); an engine served from a training rank's process turns it off: the trim would also return "
        "the rank's freed activations, which its next step then faults in again",
    )
    p.add_argument(
        "--cpu-decode-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU float32: decode attention by a C kernel compiled on first use with $CC/gcc (about 2.5x faster "
        "than matmuls; without a compiler the matmul path is used and a warning says so)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="MoE models: answer a /generate's return_routed_experts with meta_info.routed_experts (SGLang's flag)",
    )
    p.add_argument(
        "--test-off-top-k-every",
        type=int,
        default=0,
        help="test aid (MoE): on positions 0, N, 2N, ... route to the 2nd..(k+1)-th best experts instead of the "
        "top k, so that the engine's expert choice differs from a trainer's; 0 = off",
    )
    p.add_argument(
        "--start-released",
        action="store_true",
        help="read no weights: start with them released (as after /release_memory_occupation of 'weights'); "
        "generation is refused until /resume_memory_occupation and a refit load every tensor (miles-only)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a /generate call may take")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not (args.api_key or args.admin_api_key):
        p.error(
            f"--host {args.host} is not loopback: --admin-api-key (or --api-key) is required to protect the "
            "admin endpoints"
        )
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port} must be in [0, 65535]")
    for flag, value, low in [
        ("--max-running-requests", args.max_running_requests, 1),
        ("--max-total-tokens", args.max_total_tokens, 1),
        ("--context-length", args.context_length, 2),
    ]:
        if value is not None and value < low:
            p.error(f"{flag} {value} must be >= {low}")
    if args.chunked_prefill_size != -1 and args.chunked_prefill_size < 1:
        p.error(f"--chunked-prefill-size {args.chunked_prefill_size} must be >= 1, or -1 (unlimited)")
    return args


def engine_config(args: argparse.Namespace) -> LocalEngineConfig:
    """The engine's startup options from the parsed flags (`parse_args`)."""
    from miles.engines.local.engine import LocalEngineConfig

    return LocalEngineConfig(
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        chunked_prefill_size=None if args.chunked_prefill_size == -1 else args.chunked_prefill_size,
        random_seed=args.random_seed,
        weight_version=args.weight_version,
        update_group_timeout=args.update_group_timeout,
        cpu_packed_weights=args.cpu_packed_weights,
        cpu_decode_kernel=args.cpu_decode_kernel,
        trim_after_release=args.trim_after_release,
        enable_return_routed_experts=args.enable_return_routed_experts,
        test_off_top_k_every=args.test_off_top_k_every,
        start_released=args.start_released,
    )


def main(argv: list[str] | None = None) -> None:
    """Load the model and serve until interrupted."""
    args = parse_args(argv)
    from miles.utils import hang_dump
    from miles.utils.log_setup import configure_logging

    hang_dump.install_from_env(f"engine-server-port{args.port}")  # a miles run's engine: stacks on SIGUSR1

    configure_logging(args.log_level, "[%(asctime)s] %(name)s %(levelname)s: %(message)s")
    import torch
    import uvicorn

    from miles.engines.local.engine import LocalEngine
    from miles.engines.local.server import create_app

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = LocalEngine(engine_config(args))
    engine.start()
    app = create_app(
        engine, args.host, args.port, args.api_key, args.request_timeout, admin_api_key=args.admin_api_key
    )
    logging.getLogger(__name__).info(
        "embedded engine serving %s on %s:%d", args.model_path, args.host, args.port
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
