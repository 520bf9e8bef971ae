"""The deployment options select our router (or Serve's power-of-two) and our policy with Serve's
own delays zeroed, carry the SLO from one ScalingConfig, and the YAML form names the same paths."""

from __future__ import annotations

import pytest
import yaml

from autoscale.policy import TbtSloPolicy
from autoscale.router import TokenLoadRouter
from autoscale.scaling import ScalingConfig
from autoscale.serve_options import (deployment_options, graceful_shutdown_timeout, request_router_config,
                                     yaml_example)

pytestmark = pytest.mark.unit


def test_router_selection():
    ours = request_router_config("token_load", controller_name="c", namespace="n", seed=3)
    assert ours.get_request_router_class() is TokenLoadRouter
    assert ours.request_router_kwargs == {"controller_name": "c", "namespace": "n", "ranking": "token_load",
                                          "seed": 3}
    ttft = request_router_config("ttft", controller_name="c", namespace="n")
    assert ttft.get_request_router_class() is TokenLoadRouter
    assert ttft.request_router_kwargs["ranking"] == "ttft"
    assert request_router_config("power_of_two").is_default_request_router()
    with pytest.raises(ValueError, match="router"):
        request_router_config("random")


def test_autoscaling_and_shutdown_options():
    scaling = ScalingConfig(window_s=20.0, min_replicas=1, max_replicas=3)
    opts = deployment_options("token_load", scaling, 0.08, graceful_shutdown_timeout_s=300.0)
    auto = opts["autoscaling_config"]
    assert (auto.min_replicas, auto.max_replicas, auto.upscale_delay_s, auto.downscale_delay_s) == (1, 3, 0, 0)
    assert auto.policy.get_policy() is TbtSloPolicy
    policy = TbtSloPolicy(**auto.policy.policy_kwargs)  # what Serve's controller does
    assert policy.tbt_slo_s == 0.08 and policy.cfg.window_s == 20.0
    with pytest.raises(ValueError, match="tbt_slo_s"):
        deployment_options("token_load", scaling)  # the SLO comes with the scaling
    with pytest.raises(ValueError, match="max_replicas"):
        deployment_options("token_load", ScalingConfig(), 0.08)  # nothing to scale
    assert opts["graceful_shutdown_timeout_s"] == 300.0
    assert "autoscaling_config" not in deployment_options("power_of_two")
    # 2048 tokens at twice a 100 ms TBT: 410 s; short generations still get the floor.
    assert graceful_shutdown_timeout(2048, 0.1) == 410
    assert graceful_shutdown_timeout(16, 0.1) == 60.0


def test_yaml_example_names_the_real_classes():
    dep = yaml.safe_load(yaml_example())["deployments"][0]
    router = request_router_config(**{"router": "token_load"})
    assert dep["request_router_config"]["request_router_class"] == router.request_router_class
    kwargs = dep["autoscaling_config"]["policy"]["policy_kwargs"]
    assert TbtSloPolicy(**kwargs).tbt_slo_s == 0.1
