"""What the command-line tools share: how a tool reports its result or a user error, and its console script."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def run_tool(prog: str, work: Callable[[], Path | str]) -> int:
    """Run a tool's `work`: print what it returns (the path it wrote) and return 0; on a ValueError (a user
    error: bad flag, missing file) print ``prog: message`` on stderr and return 2."""
    try:
        out = work()
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def console_script(main: Callable[[], int]) -> None:
    """Exit with `main`'s status (what a console-script entry point does)."""
    sys.exit(main())
