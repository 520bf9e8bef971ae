"""The controller: the cluster's view of load, as one named Ray actor.

Replicas push their `ReplicaLoad` (`report`, fire-and-forget, ~every 50-100 ms); the router and
the autoscaling policy read `snapshot()`. The actor only gathers: per replica the latest load
and a sliding window of TBT samples; replicas silent for `stale_after_s` are dropped. Every
decision is made elsewhere, by the pure functions in `routing` and `scaling`.

The bookkeeping is the plain class `LoadBook` (a clock is injected, so it is tested without
Ray); `LoadController` is the same class as an actor. The actor is detached and named in its own
namespace: replicas, routers (in the ingress or proxy) and the policy (in Serve's controller) all
find it with `get_or_create_controller()`, and it must not die with whichever of them created it
(a replica that is scaled away, say). It restarts if it crashes; its state refills within one
report period.

Replica ids are Serve's full replica id strings (`ReplicaID.to_full_id_str()`, e.g.
`SERVE_REPLICA::app#LLMServer#abc123`): the replica reports under `current_replica_key()` and the
router and policy look replicas up by `replica_key(replica_id)`, the same string.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from autoscale.load import ClusterSnapshot, ReplicaLoad, SlidingWindow

DEFAULT_CONTROLLER_NAME = "stallfree_controller"
DEFAULT_NAMESPACE = "stallfree"


def replica_key(replica_id: Any) -> str:
    """The string a Serve `ReplicaID` is known by in reports and snapshots."""
    return replica_id.to_full_id_str() if hasattr(replica_id, "to_full_id_str") else str(replica_id)


def current_replica_key() -> str:
    """This replica's key; call inside a Serve replica."""
    from ray import serve

    return replica_key(serve.get_replica_context().replica_id)


class LoadBook:
    """Latest load and a TBT window per replica; aggregates on demand."""

    def __init__(self, window_s: float = 120.0, stale_after_s: float = 2.0,
                 max_samples_per_replica: int = 32_768, clock: Callable[[], float] = time.time) -> None:
        """`window_s` is the retention (snapshots may ask for less); beyond
        `max_samples_per_replica` the oldest samples go (at ~1k TBT samples/s per replica the
        window is then the last ~30 s whatever `window_s` says)."""
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.window_s = window_s  # retention; a snapshot may ask for a shorter window
        self.stale_after_s = stale_after_s
        self._max_samples = max_samples_per_replica
        self._clock = clock
        self._loads: dict[str, ReplicaLoad] = {}
        self._last_seen: dict[str, float] = {}  # controller clock: skew-free staleness
        self._tbt: dict[str, SlidingWindow] = {}

    def report(self, replica_id: str, load: ReplicaLoad) -> None:
        """Record one replica's load; its new TBT samples join the window at receive time."""
        now = self._clock()
        window = self._tbt.get(replica_id)
        if window is None:
            window = self._tbt[replica_id] = SlidingWindow(self.window_s, self._max_samples)
        window.extend(load.tbt_samples, now)
        self._loads[replica_id] = dataclasses.replace(load, replica_id=replica_id, tbt_samples=())
        self._last_seen[replica_id] = now

    def remove(self, replica_id: str) -> None:
        """Forget a replica now (it is shutting down)."""
        self._loads.pop(replica_id, None)
        self._last_seen.pop(replica_id, None)
        self._tbt.pop(replica_id, None)

    def drop_stale(self) -> list[str]:
        """Forget replicas that stopped reporting; returns their ids."""
        now = self._clock()
        stale = [r for r, t in self._last_seen.items() if now - t > self.stale_after_s]
        for r in stale:
            self.remove(r)
        return stale

    def replica_ids(self) -> list[str]:
        self.drop_stale()
        return sorted(self._loads)

    def snapshot(self, replica_ids: Sequence[str] | None = None, window_s: float | None = None,
                 since: float | None = None, tbt_slo_s: float | None = None,
                 with_tbt: bool = True, with_sketches: bool = False) -> ClusterSnapshot:
        """A `ClusterSnapshot` over `replica_ids` (default: all live replicas).

        TBT aggregates cover the last `window_s` (default: the retention window) and samples no
        older than `since`; `with_tbt=False` skips them (the router only needs loads). The loads'
        prefix-cache sketches (`ReplicaLoad.prefix_sketch`, up to 16 bits a KV block each) go only
        with `with_sketches` (the prefix router); everyone else gets the loads without them.
        """
        self.drop_stale()
        now = self._clock()
        ids = sorted(self._loads) if replica_ids is None else [r for r in replica_ids if r in self._loads]
        loads = {r: self._loads[r] for r in ids}
        if not with_sketches:
            loads = {r: _without_sketch(load) for r, load in loads.items()}
        samples: list[float] = []
        if with_tbt:
            start = now - min(window_s or self.window_s, self.window_s)
            since = start if since is None else max(since, start)
            for r in ids:
                samples.extend(self._tbt[r].values(now, since))
        return ClusterSnapshot.build(loads, samples, tbt_slo_s, now)


def _without_sketch(load: ReplicaLoad) -> ReplicaLoad:
    return load if load.prefix_sketch is None else dataclasses.replace(load, prefix_sketch=None)


@ray.remote(num_cpus=0, max_restarts=-1)
class LoadController(LoadBook):
    """`LoadBook` as a named, detached Ray actor: `report`, `remove`, `snapshot`, `replica_ids`."""


def get_or_create_controller(name: str = DEFAULT_CONTROLLER_NAME, namespace: str = DEFAULT_NAMESPACE,
                             **kwargs: Any) -> Any:
    """The controller's handle, creating it (with `kwargs`) if nobody has yet.

    Detached on purpose: whoever creates it first (a replica, a router, the policy) may go away.
    `kwargs` only apply to the creation; tests end it with `kill_controller`.
    """
    return LoadController.options(name=name, namespace=namespace, get_if_exists=True,
                                  lifetime="detached").remote(**kwargs)


def kill_controller(name: str = DEFAULT_CONTROLLER_NAME, namespace: str = DEFAULT_NAMESPACE) -> bool:
    """End the controller if it exists (no restart); True when one was killed."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True
