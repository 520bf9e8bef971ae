"""One node's load reports batched into one controller call, and, in a large fleet, the nodes'
batches merged again by a few hub relays: the controller's intake grows with neither the replicas
nor the nodes.

A Ray actor call costs the controller a fixed share of a millisecond of CPU whatever it carries
(docs/routing_autoscaling.md, "Fleet size"), so 1,000 replicas at 10 Hz, one call a report, is
more than one core absorbs. Each node runs a `NodeRelay` (named after the controller and the node, found or
created by the node's first reporter); its replicas' reporters send to it, and every `flush_s`
(or the longer report period the controller asks of a large fleet, so a batch still holds each
of the node's replicas once) it forwards what came in as one `report_many`: the newest load of
each replica, and the TBT gaps of all of them merged into one histogram per deployment, the form
the controller keeps them in (a report's own histogram is most of what the controller would
otherwise unpickle and add, per report). No gap is counted twice, and none is lost unless a flush
fails (the controller or a hub restarting: the batch goes with it); a replica that leaves before
the flush leaves its gaps in (they were served). The relay answers each report with the
period the controller last asked for, and the Unix socket its node's reporters send their next
reports to as datagrams (`autoscale.datagrams`: an actor call then carries one report a
heartbeat, not ten a second).

Node relays are many in a large fleet, and their flushes (ten a second each) are themselves calls
the controller pays for. So the controller's reply to a flush also says how
many hubs to flush through (`load.relay_hubs`: none while the flushes fit its budget of
`max_relay_calls_per_s`). A node relay then flushes to the hub its node hashes to (`hub_index`),
a `NodeRelay` with no node, created by the first relay that needs it. A hub merges the flushes the
same way (newest load per replica, gaps per deployment) and forwards them every `flush_s` (not at
the fleet's report period: it would add a period per hop), so the controller takes ten calls a
second per hub, and a report arrives at most one flush later. A replica that leaves tells the
controller directly; a load of it a hub still holds is then kept out (`LoadBook.remove`).

`ReportRelay` is the bookkeeping (pure, tested without Ray); `NodeRelay` is the actor around it.
Its flush loop stops when nothing has come in for `idle_s` (the next report starts it again), so
a relay whose replicas are gone costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from autoscale.controller import get_or_create_controller, without_tbt
from autoscale.datagrams import DatagramIntake, session_sockets_dir
from autoscale.demand import Demand, DemandCounts
from autoscale.keys import deployment_key
from replicas.scheduling.histogram import LogHistogram
from replicas.protocol import ReplicaLoad

logger = logging.getLogger(__name__)


class ReportRelay:
    """Reports gathered since the last flush: at most one load per replica, TBT gaps per
    deployment, and the controller's last reply."""

    def __init__(self) -> None:
        self._pending: dict[str, ReplicaLoad] = {}  # without their histograms
        self._tbt: dict[str, LogHistogram] = {}  # deployment_key -> the gaps since the last flush
        self._calls = 0  # node relays' flushes merged in (a hub's)
        # (deployment_key, source) -> the newest demand counters a source sent with its load
        self._demand: dict[tuple[str, str], DemandCounts] = {}
        self.interval_s = 0.0  # the report period the controller last asked for
        self.hubs: int | None = None  # the hubs it last asked node relays to go through (None: not heard yet)

    def __len__(self) -> int:
        return len(self._pending) + len(self._tbt) + len(self._demand)

    def add(self, replica_id: str, load: ReplicaLoad, demand: Sequence[Demand] = ()) -> float:
        """Keep `load` for the next flush, its TBT gaps added to its deployment's. A load older
        than the one kept (a report by actor call overtaken by a later one by datagram) only
        adds its gaps. `demand`: sources' demand counters riding with the load
        (`LoadReporter.demand`)."""
        for entry in demand:
            self.add_demand(*entry)
        if load.tbt_histogram:
            self._merge(deployment_key(replica_id), load.tbt_histogram)
        kept = self._pending.get(replica_id)
        if kept is None or load.timestamp >= kept.timestamp:
            self._pending[replica_id] = without_tbt(load, replica_id)
        return self.interval_s

    def add_demand(self, deployment: str, source: str, counts: DemandCounts) -> None:
        """Keep a source's demand counters for the next flush (the newest of those that came)."""
        kept = self._demand.get((deployment, source))
        self._demand[(deployment, source)] = counts if kept is None else kept.latest(counts)

    def add_many(self, reports: Sequence[tuple[str, ReplicaLoad]], tbt: Mapping[str, LogHistogram],
                 calls: int, demand: Sequence[Demand] = ()) -> tuple[float, int | None]:
        """A node relay's flush, as `LoadBook.report_many` takes it (this relay is a hub)."""
        for replica_id, load in reports:
            self._pending[replica_id] = without_tbt(load, replica_id)
        for deployment, hist in tbt.items():
            self._merge(deployment, hist)
        for entry in demand:
            self.add_demand(*entry)
        self._calls += calls
        return self.interval_s, self.hubs

    def _merge(self, deployment: str, hist: LogHistogram) -> None:
        gaps = self._tbt.get(deployment)
        if gaps is None:
            self._tbt[deployment] = hist.copy()  # the relay's own: it grows
        else:
            gaps.merge(hist)

    def discard(self, replica_id: str) -> None:
        """Forget the replica's load; its gaps stay (they were served)."""
        self._pending.pop(replica_id, None)

    def take(self) -> tuple[list[tuple[str, ReplicaLoad]], dict[str, LogHistogram], int, list[Demand]]:
        """What to forward now, as `LoadBook.report_many`'s arguments (one flush, or those a hub
        merged); the relay starts over empty."""
        batch, tbt, calls = list(self._pending.items()), self._tbt, self._calls or 1
        demand = [(deployment, source, counts) for (deployment, source), counts in self._demand.items()]
        self._pending, self._tbt, self._calls, self._demand = {}, {}, 0, {}
        return batch, tbt, calls, demand

    def took_reply(self, reply: tuple[float, int | None] | float) -> None:
        """The upstream's reply to a flush: the report period, and the hubs (a hub that has not
        heard from the controller yet says None: keep what we knew). A bare period is a
        controller that knows no hubs (an older one, still running detached): flush to it."""
        interval_s, hubs = reply if isinstance(reply, tuple) else (reply, 0)
        self.interval_s = interval_s
        if hubs is not None:
            self.hubs = hubs


def relay_name(controller_name: str, node_id: str) -> str:
    return f"{controller_name}.relay.{node_id}"


def hub_name(controller_name: str, index: int) -> str:
    return f"{controller_name}.relay.hub{index}"


def hub_index(node_id: str, hubs: int) -> int:
    """The hub a node's relay flushes through, of `hubs` (stable for a given count)."""
    return zlib.crc32(node_id.encode()) % hubs


@ray.remote(num_cpus=0, max_restarts=-1)
class NodeRelay:
    """`ReportRelay` as an async actor, flushing every `flush_s`: a node's (`node_id`), which
    flushes to the controller or, when the controller asks for hubs, to the hub its node hashes
    to; or a hub (`node_id` None), which flushes to the controller."""

    def __init__(self, controller_name: str, namespace: str, node_id: str | None, flush_s: float = 0.1,
                 idle_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.controller_name, self.namespace, self.node_id = controller_name, namespace, node_id
        self.flush_s, self.idle_s = flush_s, idle_s
        self._clock = clock
        self._relay = ReportRelay()
        self._upstream: tuple[int, Any] | None = None  # (hub index, -1 for the controller; its handle)
        self._loop: asyncio.Task[None] | None = None
        self._last_report = clock()
        self._intake: DatagramIntake | None = None  # opened by the first report by call
        self._intake_failed = False

    async def report(self, replica_id: str, load: ReplicaLoad,
                     demand: Sequence[Demand] = ()) -> tuple[float, str | None]:
        """Take one replica's report (and the demand counters riding with it); returns the
        fleet's report period and the socket the node's reporters send their next reports to as
        datagrams (`autoscale.datagrams`; None where it could not be opened: reports keep coming
        by call)."""
        self._take(replica_id, load, demand)
        if self._intake is None and not self._intake_failed:
            try:
                self._intake = await DatagramIntake.open(self._take_datagram, session_sockets_dir())
            except Exception as exc:  # noqa: BLE001 - calls still carry the reports
                self._intake_failed = True
                logger.warning("relay: no datagram socket, reports come by actor call: %r", exc)
        return self._relay.interval_s, self._intake.path if self._intake is not None else None

    def _take(self, replica_id: str, load: ReplicaLoad, demand: Sequence[Demand] = ()) -> None:
        self._wake()
        self._relay.add(replica_id, load, demand)

    def _take_datagram(self, message: Any) -> None:
        """(replica_id, load) or (replica_id, load, demands), as `LoadReporter` sends them."""
        replica_id, load, *rest = message
        demand = rest[0] if len(rest) == 1 else ()
        if not (isinstance(demand, tuple)
                and all(isinstance(d, tuple) and len(d) == 3 and isinstance(d[2], DemandCounts) for d in demand)):
            raise ValueError(f"not demand reports: {demand!r}")
        if isinstance(replica_id, str) and isinstance(load, ReplicaLoad):
            self._take(replica_id, load, demand)

    def datagrams(self) -> dict[str, Any]:
        """The datagram intake's socket and counts (None: not opened yet, or it failed)."""
        if self._intake is None:
            return {"path": None, "received": 0, "bad": 0}
        return {"path": self._intake.path, "received": self._intake.received, "bad": self._intake.bad}

    async def report_many(self, reports: Sequence[tuple[str, ReplicaLoad]], tbt: Mapping[str, LogHistogram],
                          calls: int = 1, demand: Sequence[Demand] = ()) -> tuple[float, int | None]:
        """Take a node relay's flush (a hub's intake); the controller's last reply."""
        self._wake()
        return self._relay.add_many(reports, tbt, calls, demand)

    async def remove(self, replica_id: str) -> None:
        """The replica is going: drop what it left here and tell the controller."""
        self._relay.discard(replica_id)
        await get_or_create_controller(self.controller_name, self.namespace).remove.remote(replica_id)

    def _wake(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._flush_loop())
        self._last_report = self._clock()

    def _handle(self) -> Any:
        """Where a flush goes now: the controller, or this node's hub."""
        hubs = self._relay.hubs
        index = -1 if self.node_id is None or not hubs else hub_index(self.node_id, hubs)
        if self._upstream is None or self._upstream[0] != index:
            if index < 0:
                handle = get_or_create_controller(self.controller_name, self.namespace)
            else:
                handle = get_or_create_hub(self.controller_name, self.namespace, index)
            self._upstream = (index, handle)
        return self._upstream[1]

    async def _flush_loop(self) -> None:
        while self._relay or self._clock() - self._last_report < self.idle_s:
            # A node's relay holds each replica once a batch: at the fleet's report period; a hub
            # forwards what it has every flush_s.
            await asyncio.sleep(self.flush_s if self.node_id is None else max(self.flush_s, self._relay.interval_s))
            if not self._relay:
                continue
            batch, tbt, calls, demand = self._relay.take()
            try:
                self._relay.took_reply(await self._handle().report_many.remote(batch, tbt, calls, demand))
            except Exception as exc:  # the controller or hub restarts or is re-created: look it up again
                logger.debug("relay flush failed: %r", exc)
                self._upstream = None


def get_or_create_relay(controller_name: str, namespace: str) -> Any:
    """This node's relay for `controller_name`, created here if the node has none yet."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return NodeRelay.options(name=relay_name(controller_name, node_id), namespace=namespace, get_if_exists=True,
                             lifetime="detached",
                             scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                             ).remote(controller_name, namespace, node_id)


def get_or_create_hub(controller_name: str, namespace: str, index: int) -> Any:
    """Hub relay `index` for `controller_name`, created (on any node, hubs spread) if none is yet."""
    return NodeRelay.options(name=hub_name(controller_name, index), namespace=namespace, get_if_exists=True,
                             lifetime="detached", scheduling_strategy="SPREAD").remote(controller_name, namespace, None)
