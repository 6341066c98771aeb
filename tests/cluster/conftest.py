"""The cluster tests' Ray: its settings, set before any test module imports Ray (it reads them at import), and one
local cluster for the package (each module deploys and deletes its own applications on it)."""
import os

import pytest

# A DeploymentHandle reports its ongoing requests to Ray's autoscaler every 10 s by default; every 0.5 s here, so
# that the autoscaling test sees its load within seconds (the driver's handles read it; workers inherit it).
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")


@pytest.fixture(scope="package")
def cluster():
    """A local Ray cluster of 3 CPUs with Serve and no HTTP proxy; its address, for a server to join."""
    ray = pytest.importorskip("ray")        # a guard only: `make test` installs the ray extra
    from ray import serve

    ray.init(address="local", num_cpus=3, include_dashboard=False, object_store_memory=200 * 2 ** 20)
    try:
        serve.start(proxy_location="Disabled")
        yield ray.get_runtime_context().gcs_address
    finally:
        serve.shutdown()
        ray.shutdown()
