"""The remote reward service (`python -m miles.rollout.rm_hub.server`) and the client side of `--rm-url`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from miles.rollout.rm_hub import RewardContext, RewardScorer
from miles.utils.types import Sample
from tests.integration._util import free_port


@pytest.fixture(scope="module")
def service():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.rollout.rm_hub.server", "--rm-type", "math", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "reward service did not start within 60 s"
        time.sleep(0.2)
    yield f"{url}/reward"
    proc.terminate()
    proc.wait(10)


def test_remote_reward_through_the_service(service):
    scorer = RewardScorer(RewardContext(rm_type="remote_rm", rm_url=service))
    samples = [
        Sample(index=0, response="so \\boxed{4}", label="4"),
        Sample(index=1, response="so \\boxed{5}", label="4"),
        Sample(index=2, response="Answer: 4", label="4", metadata={"rm_type": "dapo"}),  # per-sample type
    ]
    assert asyncio.run(scorer.score(samples)) == 0
    assert [s.reward for s in samples] == [1.0, 0.0, {"score": 1.0, "acc": 1.0}]
    bad = httpx.post(service, json={"response": 3})
    assert bad.status_code == 400 and "string 'response'" in bad.json()["error"]


def test_remote_reward_service_down_fails_within_the_deadline():
    url = f"http://127.0.0.1:{free_port()}/reward"  # nothing listens here
    scorer = RewardScorer(RewardContext(rm_type="remote_rm", rm_url=url, rm_timeout=2.0, rm_max_retries=2))
    with pytest.raises(RuntimeError, match=rf"sample index 7 .*phase: reward.*{url} failed for sample index 7 "
                       r"after 3 attempt\(s\)"):  # fmt: skip
        asyncio.run(scorer.score([Sample(index=7, response="1", label="1")]))
