"""The console shows our records at the run's level and other libraries' from WARNING up (all at DEBUG)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
from miles.utils.log_setup import configure_logging
configure_logging(sys.argv[1])
logging.getLogger("httpx").info('HTTP Request: POST http://e/release_memory_occupation "HTTP/1.1 200 OK"')
logging.getLogger("uvicorn.access").info("GET /health 200")
logging.getLogger("urllib3.connectionpool").info("Starting new HTTP connection")
logging.getLogger("httpx").warning("httpx warning")
logging.getLogger("miles.ray.setup").info("system ready")
logging.getLogger("miles.ray.setup").debug("miles detail")
logging.getLogger("__main__").info("main info")
"""


def _stderr(level: str) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.mark.parametrize("level", ["INFO", "info"])
def test_third_party_info_stays_off_the_console(level):
    err = _stderr(level)
    assert "system ready" in err and "main info" in err and "httpx warning" in err
    assert "HTTP Request" not in err and "GET /health" not in err and "Starting new HTTP" not in err
    assert "miles detail" not in err


def test_debug_shows_everything():
    err = _stderr("DEBUG")
    assert "HTTP Request" in err and "GET /health" in err and "miles detail" in err


def test_warning_level_applies_to_ours_too():
    err = _stderr("WARNING")
    assert "httpx warning" in err and "system ready" not in err
