"""`python -m sglang.launch_server ARGS` with the scheduler replaced (the conformance suite's engine server).

Run with .venv-sglang's python and `tests/sglang_conformance/shim` + this directory on PYTHONPATH. The command
line is parsed by SGLang's own `prepare_server_args`, the start-up is SGLang's own `Engine._launch_subprocesses`
(server-arg checks, publication, port allocation, the real `TokenizerManager`), and the HTTP server is SGLang's
own `_setup_and_run_http_server` (its FastAPI `app`, API-key middleware, warm-up). Only the scheduler and
detokenizer subprocesses are not started: `FakeScheduler` answers on the scheduler's sockets instead.
"""

from __future__ import annotations

import logging
import sys
import warnings


def main(argv: list[str]) -> None:
    """Serve SGLang's HTTP front-end for the model and flags in `argv`."""
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO)
    from fake_scheduler import FakeScheduler
    from sglang.srt.entrypoints import http_server
    from sglang.srt.entrypoints.engine import Engine, SchedulerInitResult, init_tokenizer_manager
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args([*argv, "--device", "cpu"])  # no accelerator here
    server_args.resolve_once()

    class ConformanceEngine(Engine):
        @classmethod
        def _launch_scheduler_processes(cls, server_args, port_args, run_scheduler_process_func, **kwargs):
            scheduler = FakeScheduler(server_args, port_args)
            scheduler.start()
            return SchedulerInitResult(scheduler_infos=[scheduler.info()]), []

        @classmethod
        def _launch_detokenizer_subprocesses(cls, server_args, port_args, run_detokenizer_process_func):
            return [], []

    tokenizer_manager, template_manager, port_args, init_result, watchdog, _ = (
        ConformanceEngine._launch_subprocesses(
            server_args=server_args,
            init_tokenizer_manager_func=init_tokenizer_manager,
            run_scheduler_process_func=None,
            run_detokenizer_process_func=None,
        )
    )
    http_server._setup_and_run_http_server(
        server_args, tokenizer_manager, template_manager, port_args, init_result.scheduler_infos, watchdog
    )


if __name__ == "__main__":
    import os

    from miles.engines.sglang_launch import launch_argv

    # what miles.engines.sglang_launch hands to sglang.launch_server: the keys from the environment (EngineProcess
    # passes them so), the flags in SGLang's form
    main(launch_argv(sys.argv[1:], dict(os.environ)))
