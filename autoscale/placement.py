"""How many more engine replicas the cluster can place: a replica is a set of resource bundles
(a tensor-parallel replica: one per rank, `app.args.AppArgs.placement_group`), packed on one node
under STRICT_PACK, and the autoscaler asks for no replica that no node could hold (pure; the
policy reads the nodes' free resources from Ray)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Bundle = Mapping[str, float]


def replica_need(bundles: Sequence[Bundle]) -> dict[str, float]:
    """What one replica takes of a node when its bundles are packed together."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            need[resource] = need.get(resource, 0.0) + float(amount)
    return {r: a for r, a in need.items() if a > 0}


def placeable_replicas(free_by_node: Sequence[Mapping[str, float]], bundles: Sequence[Bundle]) -> int:
    """Replicas that fit the nodes' free resources, each whole on one node (STRICT_PACK; for a
    one-bundle replica that is the only way anyway)."""
    need = replica_need(bundles)
    if not need:
        return math.inf  # type: ignore[return-value]  # needs nothing: no device bound
    total = 0
    for free in free_by_node:
        total += min(int(math.floor(free.get(r, 0.0) / a + 1e-9)) for r, a in need.items())
    return total
