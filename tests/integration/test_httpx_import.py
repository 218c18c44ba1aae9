"""`miles.utils.httpx_import.lean_httpx`: httpx imported without its command-line client, the client still there."""

import subprocess
import sys

CHECK = """
import sys
from miles.utils.httpx_import import lean_httpx
with lean_httpx():
    import httpx
print("cli_loaded=%s" % any(m in sys.modules for m in ("httpx._main", "rich", "click", "pygments")))
client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, text="ok")))
print("request=%s" % client.get("http://x/").text)
import httpx._main
print("main_is_cli=%s" % (httpx.main.__module__ == "miles.utils.httpx_import"))
print("real_main=%s" % callable(httpx._main.main))
"""


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_httpx_without_cli_imports_works_and_keeps_the_cli():
    out = run(CHECK)
    assert "cli_loaded=False" in out
    assert "request=ok" in out
    assert "main_is_cli=True" in out  # httpx.main imports the real client when called
    assert "real_main=True" in out


def test_httpx_imported_before_is_left_alone():
    out = run(
        "import sys, httpx\n"
        "from miles.utils.httpx_import import lean_httpx\n"
        "with lean_httpx():\n    import httpx\n"
        "print('main=%s' % (httpx.main is sys.modules['httpx._main'].main))\n"
        "print('cli_loaded=%s' % ('httpx._main' in sys.modules))\n"
    )
    assert "main=True" in out
    assert "cli_loaded=True" in out


def test_engine_client_is_built_without_trio():
    out = run(
        "import sys\n"
        "from miles.utils.engine_control_http import http_client\n"
        "http_client()\n"
        "print('transport=%s' % ('httpcore' in sys.modules))\n"
        "print('trio=%s' % ('trio' in sys.modules))\n"
    )
    # the client's transport (httpcore) was imported: trio would have come with it
    assert "transport=True" in out
    assert "trio=False" in out
