"""Serve deployment options for the router, the TBT-SLO policy and graceful scale-down.

The app builder turns its config into these with one call, e.g.

    opts = deployment_options(router=args.router, scaling=ScalingConfig(max_replicas=4, ...),
                              tbt_slo_s=0.1,
                              graceful_shutdown_timeout_s=graceful_shutdown_timeout(...))
    serve.deployment(LLMServer).options(**opts, max_ongoing_requests=..., ...)

or `serve_config.yaml` spells the same out (see `yaml_example`). With `autoscaling_config` set,
do not also pass `num_replicas`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from autoscale.controller import DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE
from autoscale.scaling import ScalingConfig

ROUTERS = ("token_load", "ttft", "prefix", "power_of_two")
RouterName = Literal[ROUTERS]  # type: ignore[valid-type]
TOKEN_LOAD_ROUTER = "autoscale.router.TokenLoadRouter"
TBT_SLO_POLICY = "autoscale.policy:TbtSloPolicy"


def request_router_config(router: RouterName = "token_load", *,
                          controller_name: str = DEFAULT_CONTROLLER_NAME,
                          namespace: str = DEFAULT_NAMESPACE, **router_kwargs: Any) -> RequestRouterConfig:
    """`token_load` / `ttft`: our router ranking by predicted token load or by predicted time to
    first token (`router_kwargs` go to its `initialize_state`); `power_of_two`: Serve's default,
    kept selectable for comparison."""
    if router == "power_of_two":
        return RequestRouterConfig()
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    return RequestRouterConfig(
        request_router_class=TOKEN_LOAD_ROUTER,
        request_router_kwargs={"controller_name": controller_name, "namespace": namespace,
                               "ranking": router, **router_kwargs})


def autoscaling_config(scaling: ScalingConfig, tbt_slo_s: float, *, initial_replicas: int | None = None,
                       controller_name: str = DEFAULT_CONTROLLER_NAME, namespace: str = DEFAULT_NAMESPACE,
                       replica_bundles: list[dict] | None = None) -> AutoscalingConfig:
    """Serve autoscaling driven by `TbtSloPolicy` against `tbt_slo_s`; Serve's own delays are
    zeroed because the policy's hysteresis and cool-downs already do that job (two layers would
    only add lag). Serve keeps min/max; the policy gets the rest of `scaling`."""
    if not scaling.autoscaling:
        raise ValueError("scaling.max_replicas is not set: nothing to autoscale")
    kwargs = {k: v for k, v in scaling.to_dict().items() if k not in ("min_replicas", "max_replicas")}
    kwargs["tbt_slo_s"] = tbt_slo_s
    if replica_bundles:  # what one replica takes: no upscale past what the free resources place
        kwargs["replica_bundles"] = replica_bundles
    return AutoscalingConfig(
        min_replicas=scaling.min_replicas, max_replicas=scaling.upper,
        initial_replicas=initial_replicas, upscale_delay_s=0.0, downscale_delay_s=0.0,
        policy=AutoscalingPolicy(policy_function=TBT_SLO_POLICY,
                                 policy_kwargs={"controller_name": controller_name,
                                                "namespace": namespace, **kwargs}))


def graceful_shutdown_timeout(max_generation_tokens: int, tbt_s: float, floor_s: float = 60.0) -> float:
    """Seconds a replica being scaled away may take to finish its streams: the longest
    generation at twice the TBT target, never below `floor_s`."""
    return float(max(floor_s, math.ceil(2.0 * max_generation_tokens * tbt_s)))


def deployment_options(router: RouterName = "token_load", scaling: ScalingConfig | None = None,
                       tbt_slo_s: float | None = None, *, graceful_shutdown_timeout_s: float | None = None, initial_replicas: int | None = None,
                       controller_name: str = DEFAULT_CONTROLLER_NAME, namespace: str = DEFAULT_NAMESPACE,
                       replica_bundles: list[dict] | None = None, **router_kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for `Deployment.options(...)`: router, autoscaling against `tbt_slo_s`
    (when `scaling` is given), shutdown grace."""
    opts: dict[str, Any] = {"request_router_config": request_router_config(
        router, controller_name=controller_name, namespace=namespace, **router_kwargs)}
    if scaling is not None:
        if tbt_slo_s is None:
            raise ValueError("autoscaling against the TBT SLO needs tbt_slo_s")
        opts["autoscaling_config"] = autoscaling_config(
            scaling, tbt_slo_s, initial_replicas=initial_replicas, controller_name=controller_name, namespace=namespace,
            replica_bundles=replica_bundles)
    if graceful_shutdown_timeout_s is not None:
        opts["graceful_shutdown_timeout_s"] = graceful_shutdown_timeout_s
    return opts


def yaml_example() -> str:
    """The same options as `serve_config.yaml` spells them (for docs and the README)."""
    return f"""\
deployments:
  - name: LLMServer
    graceful_shutdown_timeout_s: 600
    request_router_config:
      request_router_class: {TOKEN_LOAD_ROUTER}   # or omit for Serve's power-of-two
      request_router_kwargs: {{controller_name: {DEFAULT_CONTROLLER_NAME}, namespace: {DEFAULT_NAMESPACE}}}
    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 0
      downscale_delay_s: 0
      policy:
        policy_function: {TBT_SLO_POLICY}
        policy_kwargs: {{tbt_slo_s: 0.1, window_s: 30, downscale_margin: 0.7}}
"""
