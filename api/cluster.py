"""`slora serve --replicas N`: the single server's app in front of N engine replicas on Ray Serve.

The FastAPI app is the single server's (every route, tenant, quota and error, checked once here); its engine
is a ClusterEngine, which sends each request to a replica through Ray's DeploymentHandle. Ray routes.

For `serve.run` users: `build_app(config, settings, handle)` is the app over replicas already deployed
(`replica_app(...)` run under the name REPLICAS_APP), to be served by any ASGI server in the same process.

Ray is imported inside functions only, as in slora.api.replica.
"""
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI

from slora.api.app import create_app
from slora.api.cluster_engine import ClusterEngine
from slora.api.replica import replica_app
from slora.api.settings import ServerSettings
from slora.config import EngineConfig
from slora.engine import Engine

logger = logging.getLogger(__name__)
REPLICAS_APP = "slora-replicas"       # the Ray Serve application of the replicas


@dataclass(frozen=True)
class ClusterOptions:
    """Where the replicas run and how many: `slora serve --replicas N --ray-address ... --replica-gpus ...`."""

    replicas: int
    ray_address: str | None = None       # None: a Ray instance of this process's own, ended with it
    replica_gpus: float = 1.0
    replica_cpus: float = 1.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replica_gpus < 0 or self.replica_cpus < 0:
            raise ValueError("--replica-gpus and --replica-cpus must be >= 0")


def engine_source(config: EngineConfig, handle: Any) -> Callable[[], Engine]:
    """The ingress's engine source. AsyncEngine is typed for Engine; ClusterEngine has the part of its
    surface that AsyncEngine and the app use, hence the cast."""
    return lambda: cast(Engine, ClusterEngine(config, handle))


def build_app(config: EngineConfig, settings: ServerSettings, handle: Any) -> FastAPI:
    """The single server's app, its requests served by the replicas behind `handle`."""
    return create_app(engine_source(config, handle), settings)


def deploy(config: EngineConfig, options: ClusterOptions) -> Any:
    """Start or join Ray, deploy the replicas and wait until they serve; returns the DeploymentHandle."""
    import ray
    from ray import serve

    if options.ray_address is None:
        ray.init(include_dashboard=False)
    else:               # joining: the cluster's own settings hold
        ray.init(address=options.ray_address)
    serve.start(proxy_location="Disabled")        # the ingress is this process's server, not Ray's proxy
    app = replica_app(config, options.replicas, num_gpus=options.replica_gpus, num_cpus=options.replica_cpus)
    logger.info("deploying %d engine replica(s) on Ray Serve", options.replicas)
    return serve.run(app, name=REPLICAS_APP, route_prefix=None)


def undeploy(options: ClusterOptions) -> None:
    """Remove the replicas; end the Ray instance if this process started it."""
    import ray
    from ray import serve

    if options.ray_address is None:
        serve.shutdown()
    else:
        serve.delete(REPLICAS_APP)
    ray.shutdown()
