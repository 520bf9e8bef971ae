"""The controller: the cluster's view of load, as one named Ray actor.

Replicas push their `ReplicaLoad` (`report`, fire-and-forget, ~every 100 ms; a node's replicas
may come in one `report_many`); the router and the autoscaling policy read `snapshot()`. The
actor only gathers: per replica the latest load, per deployment a `TbtWindow` of TBT histograms in
1 s slices; replicas silent for `stale_after_s` are dropped. Every decision is made elsewhere, by
the pure functions in `routing` and `scaling`.

Sized for a fleet: a report adds its histogram's few dozen bins to one slice (no list of gaps
grows), a snapshot costs O(replicas) for the loads plus one merge of the window's slices, and
the reply to a report is the report period the fleet can afford (`max_reports_per_s` over the
live replicas), which the reporters follow.

The bookkeeping is the plain class `LoadBook` (a clock is injected, so it is tested without
Ray); `LoadController` is the same class as an actor. The actor is detached and named in its own
namespace: replicas, routers (in the ingress or proxy) and the policy (in Serve's controller) all
find it with `get_or_create_controller()`, and it must not die with whichever of them created it
(a replica that is scaled away, say). It restarts if it crashes; its state refills within one
report period.

Replica ids are Serve's full replica id strings (`autoscale.keys`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from autoscale.demand import Demand, DemandCounts, DemandLog
from autoscale.keys import deployment_key
from autoscale.load import ClusterSnapshot, LogHistogram, ReplicaLoad, TbtWindow, fleet_interval, relay_hubs
from replicas.scheduling.histogram import NUM_BINS

DEFAULT_CONTROLLER_NAME = "stallfree_controller"
DEFAULT_NAMESPACE = "stallfree"
# Reports a second the actor is asked to absorb at most (1,000 replicas at 10 Hz; what that costs
# it, through the relays' hubs: docs/routing_autoscaling.md, "Fleet size"). A larger fleet reports
# less often rather than later.
DEFAULT_MAX_REPORTS_PER_S = 10_000.0
# Relay flushes a second the actor (or a hub relay) takes at most: a Ray call costs an actor a
# fixed share of a millisecond whatever it carries, so calls, not reports, are what it counts.
# Beyond it the node relays flush through hub relays (`autoscale.relay`, `load.relay_hubs`).
DEFAULT_MAX_RELAY_CALLS_PER_S = 500.0
# How long one pickled routing view (`LoadBook.routing_view`) serves every router that asks: the
# loads in it are themselves a report period (~0.1 s) old.
DEFAULT_VIEW_MAX_AGE_S = 0.02


class LoadBook:
    """Latest load per replica and TBT histograms per deployment; aggregates on demand."""

    def __init__(self, window_s: float = 120.0, stale_after_s: float = 2.0, slice_s: float = 1.0,
                 max_reports_per_s: float = DEFAULT_MAX_REPORTS_PER_S,
                 max_relay_calls_per_s: float = DEFAULT_MAX_RELAY_CALLS_PER_S,
                 view_max_age_s: float = DEFAULT_VIEW_MAX_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        """`window_s` is the retention (snapshots may ask for less), in slices of `slice_s`."""
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        if max_reports_per_s <= 0:
            raise ValueError(f"max_reports_per_s must be > 0, got {max_reports_per_s}")
        if max_relay_calls_per_s <= 0:
            raise ValueError(f"max_relay_calls_per_s must be > 0, got {max_relay_calls_per_s}")
        self.window_s = window_s  # retention; a snapshot may ask for a shorter window
        self.stale_after_s = stale_after_s
        self.slice_s = slice_s
        self.max_reports_per_s = max_reports_per_s
        self.max_relay_calls_per_s = max_relay_calls_per_s
        self.view_max_age_s = view_max_age_s
        self._clock = clock
        self._loads: dict[str, ReplicaLoad] = {}  # as reported, less the TBT histogram
        self._plain: dict[str, ReplicaLoad] = {}  # the same less the prefix sketch
        self._last_seen: dict[str, float] = {}  # controller clock: skew-free staleness
        self._deployment: dict[str, str] = {}  # replica -> deployment_key
        self._tbt: dict[str, TbtWindow] = {}  # per deployment
        self._demand: dict[str, DemandLog] = {}  # per deployment: served and refused (autoscale.demand)
        self._views: dict[tuple[str | None, bool], tuple[float, bytes]] = {}  # routing_view's: (when, what)
        # Node relay flushes, through hubs or not: per whole second of the clock, the last full one's.
        self._calls_second, self._calls_counted, self.relay_calls_per_s = 0, 0, 0.0
        self._hubs = 0  # what the last reply to a flush asked for
        # Replicas removed (shutting down), until `stale_after_s`: a load of theirs still on its
        # way (held by a hub relay for a flush) must not bring them back.
        self._removed: dict[str, float] = {}

    def report(self, replica_id: str, load: ReplicaLoad, demand: Sequence[Demand] = ()) -> float:
        """Record one replica's load; its TBT histogram joins its deployment's window at receive
        time; `demand`, sources' counters riding with it, goes to `report_demand`. Returns the
        report period the fleet asks of each replica now (seconds)."""
        self._record(replica_id, load, self._clock())
        for entry in demand:
            self.report_demand(*entry)
        return fleet_interval(len(self._loads), self.max_reports_per_s)

    def report_demand(self, deployment: str, source: str, counts: DemandCounts) -> None:
        """A source's demand counters for `deployment` (its key: `deployment_key` of its replicas'):
        the ingress's served and refused requests, the proxy door's refusals."""
        now = self._clock()
        log = self._demand.get(deployment)
        if log is None:
            log = self._demand[deployment] = DemandLog(self.window_s, start_t=now)
        log.report(source, now, counts)

    def report_many(self, reports: Sequence[tuple[str, ReplicaLoad]],
                    tbt: Mapping[str, LogHistogram] | None = None, calls: int = 1,
                    demand: Sequence[Demand] = ()) -> tuple[float, int]:
        """`report` for several replicas in one call: a relay's flush. The relay sends the TBT
        gaps of all of them merged per deployment (`deployment_key` -> histogram) in `tbt`, rather
        than one histogram in each load, and `calls` is the node relays' flushes the call stands
        for (a hub relay's merges several); `demand`, the demand counters that rode with the loads
        (the newest of each source's). Returns the report period, as `report`, and how many
        hub relays the node relays should flush through (`load.relay_hubs`)."""
        now = self._clock()
        for replica_id, load in reports:
            self._record(replica_id, load, now)
        for entry in demand:
            self.report_demand(*entry)
        for deployment, hist in (tbt or {}).items():
            if hist:
                self._window(deployment).add(hist, now)
        self._count_calls(calls, now)
        self._hubs = relay_hubs(self.relay_calls_per_s, self.max_relay_calls_per_s, self._hubs)
        return fleet_interval(len(self._loads), self.max_reports_per_s), self._hubs

    def _count_calls(self, calls: int, now: float) -> None:
        second = math.floor(now)
        if second != self._calls_second:  # a new second: the last one's count is the rate
            self.relay_calls_per_s = self._calls_counted if second == self._calls_second + 1 else 0.0
            self._calls_second, self._calls_counted = second, 0
        self._calls_counted += calls

    def _window(self, deployment: str) -> TbtWindow:
        window = self._tbt.get(deployment)
        if window is None:
            window = self._tbt[deployment] = TbtWindow(self.window_s, self.slice_s)
        return window

    def _record(self, replica_id: str, load: ReplicaLoad, now: float) -> None:
        removed_at = self._removed.get(replica_id)
        if removed_at is not None and now - removed_at < self.stale_after_s:
            if load.tbt_histogram:  # served gaps count, but the replica stays out
                self._window(deployment_key(replica_id)).add(load.tbt_histogram, now)
            return
        deployment = self._deployment.get(replica_id)
        if deployment is None:
            deployment = self._deployment[replica_id] = deployment_key(replica_id)
        if load.tbt_histogram:
            self._window(deployment).add(load.tbt_histogram, now)
        load = without_tbt(load, replica_id)
        self._loads[replica_id] = load
        self._plain[replica_id] = load if load.prefix_sketch is None else _with(load, prefix_sketch=None)
        self._last_seen[replica_id] = now

    def remove(self, replica_id: str) -> None:
        """Forget a replica now (it is shutting down), and its loads still on their way for
        `stale_after_s`. Its gaps stay in its deployment's window until they age out: they were
        served."""
        self._forget(replica_id)
        self._removed[replica_id] = self._clock()

    def _forget(self, replica_id: str) -> None:
        self._loads.pop(replica_id, None)
        self._plain.pop(replica_id, None)
        self._last_seen.pop(replica_id, None)
        self._deployment.pop(replica_id, None)

    def drop_stale(self) -> list[str]:
        """Forget replicas that stopped reporting; returns their ids."""
        horizon = self._clock() - self.stale_after_s
        stale = [r for r, t in self._last_seen.items() if t < horizon]
        for r in stale:
            self._forget(r)
        for r in [r for r, t in self._removed.items() if t < horizon]:
            del self._removed[r]
        return stale

    def replica_ids(self) -> list[str]:
        self.drop_stale()
        return sorted(self._loads)

    def snapshot(self, replica_ids: Sequence[str] | None = None, window_s: float | None = None,
                 since: float | None = None, tbt_slo_s: float | None = None,
                 with_tbt: bool = True, with_sketches: bool = False) -> ClusterSnapshot:
        """A `ClusterSnapshot` over `replica_ids` (default: all live replicas).

        TBT aggregates cover the deployments those replicas belong to (every gap their replicas
        reported, including replicas gone since), over the last `window_s` (default: the
        retention window) and no older than `since`, both widened to whole slices; `with_tbt=False`
        skips them (the router only needs loads). The loads' prefix-cache sketches
        (`ReplicaLoad.prefix_sketch`, up to 16 bits a KV block each) go only with `with_sketches`
        (the prefix router); everyone else gets the loads without them.
        """
        self.drop_stale()
        now = self._clock()
        source = self._loads if with_sketches else self._plain
        if replica_ids is None:
            loads = {r: source[r] for r in sorted(source)}
        else:
            loads = {r: source[r] for r in replica_ids if r in source}
        if not with_tbt:
            return ClusterSnapshot.build(loads, None, tbt_slo_s, now)
        start = now - min(window_s or self.window_s, self.window_s)
        since = start if since is None else max(since, start)
        dense = [0] * NUM_BINS
        deployments = self._tbt if replica_ids is None else {self._deployment[r] for r in loads}
        served = refused = 0.0
        for deployment in self._demand if replica_ids is None else {deployment_key(r) for r in loads}:
            if (log := self._demand.get(deployment)) is not None:
                s, r = log.rates(now, since)
                served, refused = served + s, refused + r
        for deployment in list(deployments):
            window = self._tbt.get(deployment)
            if window is not None:
                window.add_window(dense, now, since)
                if not window:  # every slice aged out: the deployment's window goes
                    del self._tbt[deployment]
        snap = ClusterSnapshot.build(loads, LogHistogram.from_dense(dense), tbt_slo_s, now)
        return dataclasses.replace(snap, served_tps=served, refused_tps=refused) if served or refused else snap

    def routing_view(self, deployment: str | None = None, with_sketches: bool = False) -> bytes:
        """`snapshot(replicas, with_tbt=False, with_sketches=...)` over the live replicas of
        `deployment` (a `deployment_key`; None: all), what a router or the door reads, pickled
        (`load_view` reads it). The same bytes answer every caller that asks for the same
        deployment within `view_max_age_s`.

        Why bytes, and why by deployment: Ray pickles an actor's reply for each caller with
        cloudpickle, in Python, object by object, and a list of replica ids to filter by is one
        more thing per call to unpickle. Every router refreshes its view 20 times a second, so a
        fleet's routers would keep the controller busy pickling the same loads again. Bytes
        travel as they are (the figures: docs/routing_autoscaling.md, "Fleet size").
        """
        now = self._clock()
        key = (deployment, with_sketches)
        cached = self._views.get(key)
        if cached is not None and 0.0 <= now - cached[0] < self.view_max_age_s:  # (a clock stepped back: build)
            return cached[1]
        self.drop_stale()
        ids = None if deployment is None else sorted(r for r, d in self._deployment.items() if d == deployment)
        blob = pickle.dumps(self.snapshot(ids, with_tbt=False, with_sketches=with_sketches),
                            protocol=pickle.HIGHEST_PROTOCOL)
        self._views = {k: v for k, v in self._views.items() if 0.0 <= now - v[0] < self.view_max_age_s}
        self._views[key] = (now, blob)
        return blob


def load_view(blob: bytes) -> ClusterSnapshot:
    """A `LoadBook.routing_view` reply, read."""
    snap = pickle.loads(blob)
    if not isinstance(snap, ClusterSnapshot):
        raise TypeError(f"a routing view holds a ClusterSnapshot, not {type(snap).__name__}")
    return snap


def without_tbt(load: ReplicaLoad, replica_id: str) -> ReplicaLoad:
    """`load` as it is kept: under `replica_id`, without its TBT histogram (kept apart)."""
    if load.tbt_histogram is not None or load.replica_id != replica_id:
        return _with(load, replica_id=replica_id, tbt_histogram=None)
    return load


def _with(load: ReplicaLoad, **changes: Any) -> ReplicaLoad:
    """`dataclasses.replace` at half its cost (no __init__ by field list; ReplicaLoad checks
    nothing at construction): a copy, then its fields set."""
    out = copy.copy(load)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


@ray.remote(num_cpus=0, max_restarts=-1)
class LoadController(LoadBook):
    """`LoadBook` as a named, detached Ray actor: `report`, `report_many`, `report_demand`,
    `remove`, `snapshot`, `routing_view`, `replica_ids`."""


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
