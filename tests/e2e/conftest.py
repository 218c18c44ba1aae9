"""One Ray instance for the drivers the e2e tests run in this process.

`miles.train.main` starts a local Ray instance and stops it at the end of the run unless Ray is already up in the
process; then it uses it and, at the end, kills only what it created (its actors and placement group; see
`miles.ray.system`, each run mode's `shutdown`). Starting Ray once here instead of once per run saves its start and
stop (several seconds each on 2 cores) for every driver. A run that fails while building its system still stops
Ray; the next test starts it again. Tests marked `own_ray` (their own cluster) get no shared instance.
"""

from __future__ import annotations

import pytest

SHARED_RAY_CPUS = 8  # logical CPUs: enough bundles for any placement these tests make


_shared: dict[str, str] = {}  # "gcs": the address of the instance started here


@pytest.fixture(autouse=True)
def shared_ray(request):
    import ray

    if request.node.get_closest_marker("own_ray"):
        # stop the shared instance, not one the test's own fixtures started (they run first: wider scope)
        if ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared.get("gcs"):
            ray.shutdown()
        yield
        return
    if not ray.is_initialized():
        from miles.ray.utils import init_ray

        init_ray(min_cpus=SHARED_RAY_CPUS)
        _shared["gcs"] = ray.get_runtime_context().gcs_address
    yield


def pytest_sessionfinish(session, exitstatus):
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
