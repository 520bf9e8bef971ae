"""How replicas and deployments are named in the control plane.

Replica ids are Serve's full replica id strings (`ReplicaID.to_full_id_str()`, e.g.
`SERVE_REPLICA::app#LLMServer#abc123`): the replica reports under `current_replica_key()` and the
router and policy look replicas up by `replica_key(replica_id)`, the same string. A deployment
is known by that string less its last `#` part (`deployment_key`): the controller keeps TBT
windows, demand and routing views per deployment under it.
"""

from __future__ import annotations

from typing import Any


def replica_key(replica_id: Any) -> str:
    """The string a Serve `ReplicaID` is known by in reports and snapshots."""
    return replica_id.to_full_id_str() if hasattr(replica_id, "to_full_id_str") else str(replica_id)


def current_replica_key() -> str:
    """This replica's key; call inside a Serve replica."""
    from ray import serve

    return replica_key(serve.get_replica_context().replica_id)


def deployment_key(replica_id: str) -> str:
    """The deployment a replica key belongs to (Serve's key less its last `#` part); a key
    without one is its own."""
    return replica_id.rpartition("#")[0] or replica_id


def deployment_key_of(app_name: str | None, deployment: str) -> str:
    """The `deployment_key` of the replicas of `deployment` in application `app_name`."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    return deployment_key(replica_key(ReplicaID("_", DeploymentID(deployment, app_name or ""))))
