"""Console logging for miles's processes: our own records at the run's level, everyone else's warnings and errors.

Libraries log every HTTP request at INFO (httpx: `HTTP Request: POST .../release_memory_occupation "HTTP/1.1 200
OK"`, twice per step in the quickstart), which drowned the step lines. `configure_logging(level)` sets the root
logger to WARNING and the `miles` (and `__main__`) loggers to `level`, so third-party loggers (httpx, httpcore,
urllib3, uvicorn, filelock, ...) inherit WARNING; with `DEBUG`, everything logs at DEBUG.

Used by the driver (`miles.train`) and the embedded engine's server process. Ray actors configure no logging:
their records reach the driver's console only from WARNING up (Python's last-resort handler), and Ray's own
loggers are set to WARNING by `miles.ray.utils.init_ray`. SGLang's server logs to its own file.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OURS = ("miles", "__main__")  # `python -m miles.train` logs as __main__


def configure_logging(level: str, fmt: str = FORMAT) -> None:
    """Log to stderr: records of `OURS` from `level` up, other loggers' from WARNING up (all at DEBUG)."""
    level = level.upper()
    others = logging.DEBUG if level == "DEBUG" else logging.WARNING
    logging.basicConfig(level=others, format=fmt)
    logging.getLogger().setLevel(others)  # basicConfig leaves the level of an already configured root alone
    for name in OURS:
        logging.getLogger(name).setLevel(level)
