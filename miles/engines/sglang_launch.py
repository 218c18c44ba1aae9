"""`python -m miles.engines.sglang_launch <sglang.launch_server flags>`: SGLang's server, keys from the environment.

`/proc/<pid>/cmdline` is readable by every local user, so an engine's keys never go on its command line: the
launcher (`EngineProcess`) puts them in `MILES_ENGINE_API_KEY` / `MILES_ENGINE_ADMIN_API_KEY`, and this module
appends them to the in-process argv (which /proc does not show) before running `sglang.launch_server` as
`__main__`. The embedded engine (`python -m miles.engines.local`) reads the same variables itself.
"""

from __future__ import annotations

import os
import runpy
import sys

API_KEY_ENV, ADMIN_API_KEY_ENV = "MILES_ENGINE_API_KEY", "MILES_ENGINE_ADMIN_API_KEY"


def argv_with_keys(argv: list[str], environ: dict[str, str]) -> list[str]:
    """`argv` plus `--api-key` / `--admin-api-key` from `environ` (a flag already in `argv` wins)."""
    out = list(argv)
    for flag, name in (("--api-key", API_KEY_ENV), ("--admin-api-key", ADMIN_API_KEY_ENV)):
        if environ.get(name) and flag not in out:
            out += [flag, environ[name]]
    return out


def main() -> None:
    """Run `sglang.launch_server` with the keys from the environment on its argv."""
    sys.argv = ["sglang.launch_server", *argv_with_keys(sys.argv[1:], dict(os.environ))]
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV):  # SGLang's children need not see them
        os.environ.pop(name, None)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
