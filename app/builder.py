"""Application builder: `import_path: app.builder:build_app` in serve_config.yaml.

Serve calls `build_app(args)` with the `args:` mapping of the config file; tests call
`serve.run(build_app({...}))`. Arguments are validated here, at build time, with pydantic's
field-by-field errors, before any replica starts.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig

from app.args import AppArgs
from app.ingress import OpenAIIngress
from app.http_path import proxy_kind
from app.ingress_router import INGRESS_ROUTER_DEPLOYMENT, IngressRouter
from app.replica_ingress import ReplicaIngress
from autoscale.reporter import LoadReporter
from autoscale.serve_options import deployment_options, graceful_shutdown_timeout
from replicas.serving.deployment import LLMServer

logger = logging.getLogger(__name__)

LLM_DEPLOYMENT = "LLMServer"
# The shutdown grace of a replica is sized before the model loads: without an SLO or a length
# limit it assumes a slow token (100 ms) and a common context length.
UNSET_TBT_SLO_S = 0.1
UNSET_MAX_MODEL_LEN = 4096
INGRESS_DEPLOYMENT = "OpenAIIngress"
# No access-log line per request in the replicas (serve_config.yaml's `logging_config` says the
# same to the proxy): one formatted, flushed line per request on the hot path, which the app's
# metrics (responses by route and status, latencies) already count.
REPLICA_LOGGING = {"enable_access_log": False}
# Serve's health probe of an engine replica (LLMServer.check_health): how often, and how long one
# may take before Serve counts the replica unhealthy and replaces it.
HEALTH_CHECK_PERIOD_S = 5
HEALTH_CHECK_TIMEOUT_S = 30
# The ingress's handlers run on the replica's own event loop, not on a second one in a thread:
# one loop relays every token, so its lag (what the in-flight limit, app/stream_limit.py, reads)
# is the lag of all the ingress's work, and no item crosses threads.
INGRESS_RUNTIME_ENV = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
# The ingress request router's handler and its handle's router on the server's own event loop
# too: a route call then crosses no thread (three loops and a thread pool by Serve's defaults).
ONE_LOOP_RUNTIME_ENV = {"env_vars": {**INGRESS_RUNTIME_ENV["env_vars"], "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}}


def llm_deployment_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of the engine replicas: resources, concurrency, replica count."""
    options: dict[str, Any] = {
        "name": LLM_DEPLOYMENT,
        # Admission is the engine's job, by tokens; Serve's default of 5 would throttle streams.
        "max_ongoing_requests": args.max_ongoing_requests,
        # A backstop behind the door's token admission: Serve's own handle queue is bounded too
        # (BackPressureError -> 429 in app.errors).
        "max_queued_requests": args.max_queued_requests,
        "ray_actor_options": {"num_cpus": args.resolved_num_cpus, "num_gpus": args.num_gpus},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "logging_config": REPLICA_LOGGING,
        **(args.placement_group() or {}),
    }
    scaling = args.scaling_config() if args.scaling.autoscaling and args.scaling.by == "tbt_slo" else None
    if args.scaling.autoscaling and scaling is None:
        options["autoscaling_config"] = {
            "min_replicas": args.scaling.min_replicas,
            "max_replicas": args.scaling.upper,
            "target_ongoing_requests": args.scaling.target_ongoing_requests,
        }
    if not args.scaling.autoscaling:
        options["num_replicas"] = args.num_replicas
    # A replica chosen to go away finishes its streams: the longest generation at twice the SLO.
    engine = args.engine
    tbt_s = engine.tbt_slo_s or UNSET_TBT_SLO_S
    max_len = engine.max_model_len or UNSET_MAX_MODEL_LEN
    router_kwargs = {"prefix_imbalance": args.prefix_imbalance} if args.router == "prefix" else {}
    options.update(deployment_options(
        args.router, scaling, engine.tbt_slo_s, graceful_shutdown_timeout_s=graceful_shutdown_timeout(max_len, tbt_s),
        controller_name=args.controller_name, namespace=args.controller_namespace,
        replica_bundles=args.replica_bundles(), **router_kwargs))
    return options


def replica_ingress_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of engine replicas that serve HTTP themselves (`ingress_in_replica`): the
    engine replica's, with the ingress's request cap, queue and event loop."""
    options = llm_deployment_options(args)
    actor = dict(options["ray_actor_options"])
    env = {**actor.get("runtime_env", {}).get("env_vars", {}), **INGRESS_RUNTIME_ENV["env_vars"]}
    actor["runtime_env"] = {**actor.get("runtime_env", {}), "env_vars": env}
    options.update(
        ray_actor_options=actor, max_ongoing_requests=args.ingress_max_ongoing_requests,
        max_queued_requests=args.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1))
    if proxy_kind() == "haproxy" and not args.asks_router():  # HAProxy chooses (or has no choice),
        options.pop("request_router_config", None)  # and Serve refuses a router it would not ask
    return options


def ingress_router_options() -> dict[str, Any]:
    """Serve options of the ingress request router (HAProxy mode, `app.ingress_router`): no CPU
    reserved (it schedules beside the proxy, as Ray Serve LLM's does) and no cap that would hold
    back the requests it routes."""
    return {"name": INGRESS_ROUTER_DEPLOYMENT, "num_replicas": 1, "max_ongoing_requests": 1000,
            "ray_actor_options": {"num_cpus": 0, "runtime_env": ONE_LOOP_RUNTIME_ENV},
            "logging_config": REPLICA_LOGGING}


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Build the OpenAI app: an ingress deployment bound to the engine replica deployment, or
    (`ingress_in_replica`) engine replicas serving HTTP themselves."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    # The replica reports its load to the controller through this (replicas/ imports nothing above it).
    reporter = functools.partial(LoadReporter, controller_name=app_args.controller_name,
                                 namespace=app_args.controller_namespace)
    if app_args.ingress_in_replica:
        merged = serve.deployment(ReplicaIngress).options(**replica_ingress_options(app_args))
        app = merged.bind(app_args.replica_config(), app_args, reporter_factory=reporter)
        haproxy = proxy_kind() == "haproxy"
        if haproxy and app_args.asks_router():  # HAProxy asks the app's router
            app._with_ingress_request_router(serve.deployment(IngressRouter).options(**ingress_router_options()).bind(app))
        elif app_args.ingress_router and not haproxy:
            logger.warning("ingress_router is for Ray's HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY=1); "
                           "Serve's proxy routes with the app's router already")
        return app
    llm = serve.deployment(LLMServer).options(**llm_deployment_options(app_args))
    ingress = OpenAIIngress.options(
        name=INGRESS_DEPLOYMENT, num_replicas=app_args.resolved_ingress_replicas,
        max_ongoing_requests=app_args.ingress_max_ongoing_requests,
        # The last backstop, in the proxy: Serve's own answer (plain text, not OpenAI's shape).
        max_queued_requests=app_args.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1), logging_config=REPLICA_LOGGING,
        ray_actor_options={"num_cpus": app_args.ingress_num_cpus, "runtime_env": INGRESS_RUNTIME_ENV})
    return ingress.bind(llm.bind(app_args.replica_config(), reporter_factory=reporter), app_args)
