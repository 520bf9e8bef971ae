"""The autoscaler asks for no replica the cluster cannot place: a replica's bundles packed on one
node (a tensor-parallel replica needs tp GPUs together), counted over the nodes' free resources;
an upscale the devices cannot hold stops there and says so (`:no_devices`)."""

from __future__ import annotations

import pytest

from autoscale.load import ClusterSnapshot, ReplicaLoad
from autoscale.placement import placeable_replicas, replica_need
from autoscale.scaling import ScalingConfig, ScalingState, decide_replicas

pytestmark = pytest.mark.unit

TP2 = [{"CPU": 4, "GPU": 1}, {"GPU": 1}]


def test_a_replica_needs_its_bundles_on_one_node() -> None:
    assert replica_need(TP2) == {"CPU": 4.0, "GPU": 2.0}
    # 3 free GPUs on each of two nodes hold one TP=2 replica each, not three (no spanning nodes)
    assert placeable_replicas([{"CPU": 16, "GPU": 3}, {"CPU": 16, "GPU": 3}], TP2) == 2
    assert placeable_replicas([{"CPU": 16, "GPU": 8}], TP2) == 4
    assert placeable_replicas([{"CPU": 6, "GPU": 8}], TP2) == 1  # the CPUs run out first
    assert placeable_replicas([{"CPU": 1.5}], [{"CPU": 0.5}, {"CPU": 0.5}]) == 1
    assert placeable_replicas([], TP2) == 0


def snap(p99: float) -> ClusterSnapshot:
    loads = {f"r{i}": ReplicaLoad(f"r{i}", running_tokens=500) for i in range(2)}
    return ClusterSnapshot(loads, p99, p99, 100, None, 0.0)


def test_an_upscale_stops_at_what_the_devices_can_place_and_says_so() -> None:
    cfg = ScalingConfig(min_replicas=1, max_replicas=8, queued_tokens_per_replica=4096)
    n, state = decide_replicas(snap(0.5), 2, ScalingState(), now=100.0, cfg=cfg, tbt_slo_s=0.1, placeable=1)
    assert n == 3  # the breach would add one; one fits
    n, state = decide_replicas(snap(0.5), 2, ScalingState(), now=100.0, cfg=cfg, tbt_slo_s=0.1, placeable=0)
    assert n == 2 and state.reason == "tbt_p99_over_slo:no_devices"
    n, state = decide_replicas(snap(0.5), 8, ScalingState(), now=100.0, cfg=cfg, tbt_slo_s=0.1, placeable=0)
    assert state.reason.endswith(":at_max")  # the configured ceiling is named first
    # a target already asked for is not taken back for want of devices
    n, _ = decide_replicas(snap(0.5), 2, ScalingState(), now=100.0, cfg=cfg, tbt_slo_s=0.1, target=4, placeable=0)
    assert n == 4
    n, _ = decide_replicas(snap(0.5), 2, ScalingState(), now=100.0, cfg=cfg, tbt_slo_s=0.1)
    assert n == 3  # unbounded without the count
