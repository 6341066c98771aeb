"""`slora serve --replicas N`: the single server's app in front of N engine replicas on Ray Serve.

The FastAPI app is the single server's (every route, tenant, quota and error, checked once here); its engine
is a ClusterEngine, which sends each request to a replica through Ray's DeploymentHandle. Ray routes.

For `serve.run` users: `build_app(config, settings, handle)` is the app over replicas already deployed
(`replica_app(...)` run under the name REPLICAS_APP), to be served by any ASGI server in the same process.

Ray is imported inside functions only, as in slora.api.replica.
"""
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from slora.api.app import create_app
from slora.api.cluster_engine import ClusterEngine
from slora.api.replica import DEFAULT_DRAIN_TIMEOUT_S, Autoscaling, board, replica_app
from slora.api.settings import ServerSettings
from slora.config import EngineConfig

logger = logging.getLogger(__name__)
REPLICAS_APP = "slora-replicas"       # the Ray Serve application of the replicas


@dataclass(frozen=True)
class ClusterOptions:
    """Where the replicas run and how many: `slora serve --replicas N --ray-address ... --replica-gpus ...`,
    with `--autoscale-min/--autoscale-max` Ray's autoscaling between the two, from N."""

    replicas: int
    ray_address: str | None = None       # None: a Ray instance of this process's own, ended with it
    replica_gpus: float = 1.0
    replica_cpus: float = 1.0
    autoscaling: Autoscaling | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replica_gpus < 0 or self.replica_cpus < 0:
            raise ValueError("--replica-gpus and --replica-cpus must be >= 0")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"--replica-drain-timeout must be positive, got {self.drain_timeout_s}")


def cluster_engine(config: EngineConfig, handle: Any, app_name: str = REPLICAS_APP) -> ClusterEngine:
    """The ingress's engine over the replicas behind `handle` (a replica tells their pool's size); their
    snapshots read from the application's board. Runs on AsyncEngine's thread: it may block."""
    pool_pages = handle.pool_pages.remote().result()
    return ClusterEngine(config, handle, pool_pages=pool_pages, board=board(app_name))


def build_app(config: EngineConfig, settings: ServerSettings, handle: Any, app_name: str = REPLICAS_APP) -> FastAPI:
    """The single server's app, its requests served by the replicas behind `handle` (the Ray Serve application
    `app_name`, made by `replica_app`)."""
    return create_app(lambda: cluster_engine(config, handle, app_name), settings)


def cluster_app(config: EngineConfig, settings: ServerSettings, options: ClusterOptions) -> FastAPI:
    """`slora serve --replicas`: Ray started or joined now; the replicas deployed by the engine source, on the
    engine's thread, so that the server answers /health (starting) and signals while they come up."""
    start_ray(options)
    return create_app(lambda: cluster_engine(config, deploy(config, options)), settings)


def start_ray(options: ClusterOptions) -> None:
    """Start or join Ray, with Serve and without Ray's HTTP proxy (this process's server is the ingress)."""
    import ray
    from ray import serve

    if options.ray_address is None:
        ray.init(include_dashboard=False)
    else:               # joining: the cluster's own settings hold
        ray.init(address=options.ray_address)
    serve.start(proxy_location="Disabled")


def deploy(config: EngineConfig, options: ClusterOptions) -> Any:
    """Deploy the replicas on the Ray of `start_ray` and wait until they serve; returns the DeploymentHandle."""
    from ray import serve

    app = replica_app(config, options.replicas, num_gpus=options.replica_gpus, num_cpus=options.replica_cpus,
                      autoscaling=options.autoscaling, drain_timeout_s=options.drain_timeout_s)
    logger.info("deploying %d engine replica(s) on Ray Serve", options.replicas)
    handle = serve.run(app, name=REPLICAS_APP, route_prefix=None)
    logger.info("%d engine replica(s) serving", options.replicas)
    return handle


def undeploy(options: ClusterOptions) -> None:
    """Remove the replicas; end the Ray instance if this process started it."""
    import ray
    from ray import serve

    if options.ray_address is None:
        serve.shutdown()
    else:
        serve.delete(REPLICAS_APP)
        ray.kill(board(REPLICAS_APP))
    ray.shutdown()
