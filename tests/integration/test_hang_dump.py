"""Hang forensics (`miles.utils.hang_dump`): a stalled engine whose request deadline expires and a SIGUSR1 to a
driver-like process each leave every process's stacks in `<run-dir>/logs/hang-<time>/`, showing where each was.

The processes are small Python subprocesses that install the dumps as miles processes do; the stalled engine is
an HTTP server whose handler never answers (it sleeps in `stalled_generate`), called through the real
`miles.utils.engine_control_http.request`, whose `EngineTimeout` names the folder and the engine.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from miles.utils import hang_dump

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENGINE = textwrap.dedent(
    """
    import http.server, sys, time
    from miles.utils import hang_dump

    def stalled_generate():
        time.sleep(600)

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            stalled_generate()

        def log_message(self, *a):
            pass

    hang_dump.install_from_env("engine-server-port%d" % int(sys.argv[1]))
    srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    print("ready", flush=True)
    srv.serve_forever()
    """
)

TRAINER = textwrap.dedent(
    """
    import sys, time
    from miles.utils import hang_dump

    def training_step_that_hangs():
        print("ready", flush=True)
        time.sleep(600)

    hang_dump.install(sys.argv[1], "trainer-actor-rank0")
    training_step_that_hangs()
    """
)

DRIVER = textwrap.dedent(
    """
    import sys, time
    from miles.utils import hang_dump

    def driver_waits_for_rollout():
        print("ready", flush=True)
        while True:
            time.sleep(0.1)

    hang_dump.install(sys.argv[1], "driver", driver=True)
    driver_waits_for_rollout()
    """
)


def _start(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        p.kill()
        p.wait()
    hang_dump.uninstall()


def _free_port() -> int:
    from miles.utils.net import free_port

    return free_port("127.0.0.1")


def _read(folder: str, role: str) -> str:
    files = glob.glob(os.path.join(folder, f"{role}-pid*.txt"))
    assert len(files) == 1, (role, os.listdir(folder))
    with open(files[0]) as f:
        return f.read()


def test_a_request_deadline_on_a_stalled_engine_dumps_every_process(tmp_path, procs):
    from miles.utils.engine_control_http import EngineTimeout, request

    stacks = hang_dump.stacks_dir_of(str(tmp_path))
    hang_dump.install(stacks, "trainer-actor-rank1")  # this process: the trainer whose refit call times out
    port = _free_port()
    procs.append(_start(ENGINE, str(port), env={hang_dump.STACKS_DIR_ENV: stacks}))
    procs.append(_start(TRAINER, stacks))
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(EngineTimeout) as info:
        request("POST", url, "generate", "refit", timeout_s=1.0)
    message = str(info.value)
    assert url in message, message
    folders = glob.glob(os.path.join(tmp_path, "logs", "hang-*"))
    assert len(folders) == 1 and folders[0] in message, (folders, message)
    engine = _read(folders[0], f"engine-server-port{port}")
    assert "stalled_generate" in engine and "do_POST" in engine, engine
    assert "training_step_that_hangs" in _read(folders[0], "trainer-actor-rank0")
    # the process that took the dump: its own stacks, the deadline's caller among them
    assert "test_a_request_deadline_on_a_stalled_engine" in _read(folders[0], "trainer-actor-rank1")
    with open(os.path.join(folders[0], "index.txt")) as f:
        index = f.read()
    assert f"stalled: engine {url}" in index and f"engine-server-port{port} pid {procs[0].pid}" in index, (
        index
    )


def test_sigusr1_to_the_driver_dumps_every_process(tmp_path, procs):
    stacks = hang_dump.stacks_dir_of(str(tmp_path))
    driver = _start(DRIVER, stacks)
    procs.append(driver)
    procs.append(_start(TRAINER, stacks))
    driver.send_signal(signal.SIGUSR1)
    folder = None
    for _ in range(200):  # the driver dumps from a thread; index.txt is written last
        found = glob.glob(os.path.join(tmp_path, "logs", "hang-*", "index.txt"))
        if found:
            folder = os.path.dirname(found[0])
            break
        time.sleep(0.05)
    assert folder is not None, os.listdir(os.path.join(tmp_path, "logs"))
    assert "driver_waits_for_rollout" in _read(folder, "driver")
    assert "training_step_that_hangs" in _read(folder, "trainer-actor-rank0")
    assert driver.poll() is None  # the driver goes on
    with open(os.path.join(folder, "index.txt")) as f:
        assert f.read().startswith("reason: SIGUSR1 to the driver\n")


def test_a_dump_taken_by_another_process_includes_the_driver_and_skips_the_gone(tmp_path, procs):
    stacks = hang_dump.stacks_dir_of(str(tmp_path))
    procs.append(_start(DRIVER, stacks))
    gone = _start(TRAINER, stacks)
    gone.kill()
    gone.wait()
    hang_dump.install(stacks, "rollout-manager")
    folder = hang_dump.dump_all("test", "the rollout manager", wait_s=5.0)
    assert folder is not None
    assert "driver_waits_for_rollout" in _read(folder, "driver")  # SIGUSR2: its own stacks only
    assert not glob.glob(os.path.join(folder, "trainer-*"))  # its pid may be reused: never signalled
    assert hang_dump.dump_all("again", "x") == folder  # a burst of expiries takes one dump


def test_without_install_nothing_is_dumped_and_the_message_is_unchanged(tmp_path):
    hang_dump.uninstall()
    assert hang_dump.dump_all("r", "s") is None
    assert hang_dump.expired("timed out", "engine x") == "timed out"


def test_a_stopped_process_is_listed_as_not_answering(tmp_path, procs):
    stacks = hang_dump.stacks_dir_of(str(tmp_path))
    stopped = _start(TRAINER, stacks)
    procs.append(stopped)
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        hang_dump.install(stacks, "driver-like")
        folder = hang_dump.dump_all("test", "trainer", wait_s=0.5)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert folder is not None
    with open(os.path.join(folder, "index.txt")) as f:
        index = f.read()
    assert f"trainer-actor-rank0 pid {stopped.pid}: no dump within 0.5s" in index, index
