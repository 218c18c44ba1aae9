"""`python -m miles.engines.sglang_launch <flags>`: SGLang's server, its flags in SGLang's form, keys from the environment.

`/proc/<pid>/cmdline` is readable by every local user, so an engine's keys never go on its command line: the
launcher (`EngineProcess`) puts them in `MILES_ENGINE_API_KEY` / `MILES_ENGINE_ADMIN_API_KEY`, and this module
appends them to the in-process argv (which /proc does not show) before running `sglang.launch_server` as
`__main__`. The embedded engine (`python -m miles.engines.local`) reads the same variables itself.

The flags come as `miles.engines.sglang_args.flag_args` writes them (every value in its flag's token,
`--NAME=VALUE`, so a value starting with '-' is not read as a flag); here, where SGLang is installed, its own
parser turns a switch's `--NAME=true|false` and a several-valued option's `--NAME=V1 V2` into SGLang's form
(`sglang_args.sglang_form`).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping

API_KEY_ENV, ADMIN_API_KEY_ENV = "MILES_ENGINE_API_KEY", "MILES_ENGINE_ADMIN_API_KEY"


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(token == flag or token.startswith(flag + "=") for token in argv)


def argv_with_keys(argv: list[str], environ: Mapping[str, str]) -> list[str]:
    """`argv` plus `--api-key=KEY` / `--admin-api-key=KEY` from `environ` (a flag already in `argv` wins). One
    token each: a key may start with '-' (`secrets.token_urlsafe` draws one about once in 64), which argparse
    would read as an option if it came as a token of its own."""
    out = list(argv)
    for flag, name in (("--api-key", API_KEY_ENV), ("--admin-api-key", ADMIN_API_KEY_ENV)):
        if environ.get(name) and not _has_flag(out, flag):
            out.append(f"{flag}={environ[name]}")
    return out


def launch_argv(argv: list[str], environ: Mapping[str, str]) -> list[str]:
    """The argv `sglang.launch_server` gets: `argv` with the keys from `environ`, in SGLang's form (imports
    SGLang's server arguments)."""
    from miles.engines.sglang_args import sglang_form, sglang_parser

    return sglang_form(argv_with_keys(argv, environ), sglang_parser())


def main() -> None:
    """Run `sglang.launch_server` with the keys from the environment on its argv."""
    sys.argv = ["sglang.launch_server", *launch_argv(sys.argv[1:], dict(os.environ))]
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV):  # SGLang's children need not see them
        os.environ.pop(name, None)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
