"""Every (method, path) an ASGI app serves, routers included by `include_router` walked too.

`python tests/sglang_conformance/routes.py` (with .venv-sglang's python) prints SGLang's HTTP server's as JSON."""

from __future__ import annotations

import json
import re
from typing import Any

_PARAM = re.compile(r"\{[^}]*\}")


def app_routes(routes: list[Any], prefix: str = "") -> list[tuple[str, str]]:
    """(method, path) of `routes` (an app's `.routes`), GET and POST only, path parameters filled with 'x'."""
    out: set[tuple[str, str]] = set()
    for route in routes:
        if hasattr(route, "path"):
            for method in getattr(route, "methods", None) or {"GET"}:
                if method in ("GET", "POST"):
                    out.add((method, _PARAM.sub("x", prefix + route.path)))
        elif hasattr(route, "original_router"):  # fastapi's _IncludedRouter
            out.update(app_routes(route.original_router.routes, prefix + route.include_context.prefix))
    return sorted(out)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    from sglang.srt.entrypoints.http_server import app

    print(json.dumps(app_routes(app.routes)))
