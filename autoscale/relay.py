"""One node's load reports batched into one controller call: the controller's intake then grows
with the nodes, not the replicas.

A Ray actor call costs the controller a fixed few hundred microseconds whatever it carries
(loadtests/bench/fleet.py), so 1,000 replicas at 10 Hz, one call a report, is more than one
core absorbs. Each node runs a `NodeRelay` (named after the controller and the node, found or
created by the node's first reporter); its replicas' reporters send to it, and every `flush_s`
(or the longer report period the controller asks of a large fleet, so a batch still holds each
of the node's replicas once) it forwards what came in as one `report_many`. Between two flushes a
replica's newer load replaces its older one and their TBT histograms add up, so no gap is lost.
The relay answers each report with the period the controller last asked for.

`ReportRelay` is the bookkeeping (pure, tested without Ray); `NodeRelay` is the actor around it.
Its flush loop stops when nothing has come in for `idle_s` (the next report starts it again), so
a relay whose replicas are gone costs nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from replicas.protocol import ReplicaLoad

logger = logging.getLogger(__name__)


class ReportRelay:
    """Reports gathered since the last flush, at most one per replica."""

    def __init__(self) -> None:
        self._pending: dict[str, ReplicaLoad] = {}
        self.interval_s = 0.0  # the period the controller last asked for

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, replica_id: str, load: ReplicaLoad) -> float:
        """Keep `load` for the next flush (its TBT gaps added to any not yet forwarded)."""
        older = self._pending.get(replica_id)
        if older is not None and older.tbt_histogram:
            gaps = older.tbt_histogram  # the relay's own copy: it may grow
            if load.tbt_histogram:
                gaps.merge(load.tbt_histogram)
            load = dataclasses.replace(load, tbt_histogram=gaps)
        self._pending[replica_id] = load
        return self.interval_s

    def discard(self, replica_id: str) -> None:
        self._pending.pop(replica_id, None)

    def take(self) -> list[tuple[str, ReplicaLoad]]:
        """What to forward now; the relay starts over empty."""
        batch, self._pending = list(self._pending.items()), {}
        return batch


def relay_name(controller_name: str, node_id: str) -> str:
    return f"{controller_name}.relay.{node_id}"


@ray.remote(num_cpus=0, max_restarts=-1)
class NodeRelay:
    """`ReportRelay` as an async actor on one node, flushing to the controller every `flush_s`."""

    def __init__(self, controller_name: str, namespace: str, flush_s: float = 0.1, idle_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.controller_name, self.namespace = controller_name, namespace
        self.flush_s, self.idle_s = flush_s, idle_s
        self._clock = clock
        self._relay = ReportRelay()
        self._controller: Any = None
        self._loop: asyncio.Task[None] | None = None
        self._last_report = clock()

    async def report(self, replica_id: str, load: ReplicaLoad) -> float:
        """Take one replica's report; returns the fleet's report period."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._flush_loop())
        self._last_report = self._clock()
        return self._relay.add(replica_id, load)

    async def remove(self, replica_id: str) -> None:
        """The replica is going: drop what it left here and tell the controller."""
        self._relay.discard(replica_id)
        await self._handle().remove.remote(replica_id)

    def _handle(self) -> Any:
        if self._controller is None:
            from autoscale.controller import get_or_create_controller

            self._controller = get_or_create_controller(self.controller_name, self.namespace)
        return self._controller

    async def _flush_loop(self) -> None:
        while self._relay or self._clock() - self._last_report < self.idle_s:
            await asyncio.sleep(max(self.flush_s, self._relay.interval_s))
            batch = self._relay.take()
            if not batch:
                continue
            try:
                self._relay.interval_s = await self._handle().report_many.remote(batch)
            except Exception as exc:  # the controller restarts or is re-created: look it up again
                logger.debug("relay flush failed: %r", exc)
                self._controller = None


def get_or_create_relay(controller_name: str, namespace: str) -> Any:
    """This node's relay for `controller_name`, created here if the node has none yet."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return NodeRelay.options(name=relay_name(controller_name, node_id), namespace=namespace, get_if_exists=True,
                             lifetime="detached",
                             scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                             ).remote(controller_name, namespace)
