"""Import httpx without the imports of its command-line client.

`import httpx` runs `from ._main import main`, which imports click, pygments and rich for the `httpx` command: about
0.1 s of CPU in every miles process that talks HTTP (the driver, the engine fleet, the rollout manager, the engine
actors and servers, each training rank on its first refit), none of which runs that command. Inside `lean_httpx()`
that one submodule is not found, so httpx takes its own fallback; `httpx.main` is then replaced by a function that
imports the real client when called, so the command still works. Nothing changes once httpx is imported already, or
where its client was imported first.

`lean_transport()`: httpx imports its transport (httpcore) when the first client is built, and httpcore's
synchronization module imports trio at module level to serve trio programs (~0.07 s of CPU per process); inside the
block `trio` is a stand-in (`miles.utils.lazy_import`) that imports the real one only if code runs under trio,
which miles never does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from miles.utils.lazy_import import deferred

CLI_MODULE = "httpx._main"


@contextlib.contextmanager
def lean_httpx() -> Iterator[None]:
    """`import httpx` inside this block leaves httpx's command-line client unimported (see the module doc)."""
    if "httpx" in sys.modules or CLI_MODULE in sys.modules:
        yield
        return
    sys.modules[CLI_MODULE] = None  # type: ignore[assignment]  # None: "not found" to the import system
    try:
        yield
    finally:
        if sys.modules.get(CLI_MODULE, 0) is None:
            del sys.modules[CLI_MODULE]
    httpx = sys.modules.get("httpx")
    if httpx is not None:
        httpx.main = _cli_main  # type: ignore[attr-defined]


@contextlib.contextmanager
def lean_transport() -> Iterator[None]:
    """Build httpx clients inside this block: their transport's import leaves trio unimported (see the module doc)."""
    with deferred({"trio": ()}):
        yield


def _cli_main() -> None:
    """httpx's command-line client, imported when it is run."""
    from httpx._main import main

    main()
