"""The cluster's view of load: the aggregate of replica loads and time-sliced TBT histograms.

A replica pushes its `replicas.protocol.ReplicaLoad` (the one load record, built by its
scheduler) to the controller at iteration granularity, with a histogram of the TBT gaps new since
its previous report (`replicas.scheduling.histogram.LogHistogram`); a `ClusterSnapshot` is what the router,
the door's admission and the scaling decision read back. Both are plain frozen dataclasses,
pickled as they are across Ray, and nothing here imports Ray: the simulator builds the same
snapshots from its own replicas.

TBT over a window is a merge of per-slice histograms (`TbtWindow`): its cost is the number of
slices times the bins in use, whatever the traffic, and its percentiles are within
`replicas.scheduling.histogram.RELATIVE_ERROR` (0.99%) of the exact nearest-rank ones.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from replicas.scheduling.histogram import NUM_BINS, LogHistogram
from replicas.protocol import ReplicaLoad

__all__ = ["ClusterSnapshot", "LogHistogram", "ReplicaLoad", "ReportThrottle", "TbtWindow", "fleet_interval",
           "percentile", "relay_hubs"]


@dataclass(frozen=True)
class ReportThrottle:
    """When a replica sends its next load report: every `interval_s` (or the longer period the
    controller asks of a large fleet, `fleet_interval_s`), sooner (but not within
    `min_interval_s`) when its token load moved by `change_tokens` or `change_fraction` of the
    last reported load; a load that has not `changed` (an idle replica) only every
    `heartbeat_s`, which must stay under the controller's `stale_after_s` (2 s). The reporter's
    rule, and the simulator's."""

    interval_s: float = 0.1
    min_interval_s: float = 0.02
    change_tokens: int = 256
    change_fraction: float = 0.25
    heartbeat_s: float = 1.0

    def due(self, elapsed_s: float, token_change: int, last_tokens: int, changed: bool = True,
            fleet_interval_s: float = 0.0) -> bool:
        elapsed = elapsed_s + 1e-9  # float clocks: 0.3 - 0.2 < 0.1
        if not changed:
            return elapsed >= self.heartbeat_s
        if elapsed >= max(self.interval_s, fleet_interval_s):
            return True
        jump = abs(token_change) >= max(self.change_tokens, self.change_fraction * last_tokens)
        return jump and elapsed >= self.min_interval_s


def fleet_interval(num_replicas: int, max_reports_per_s: float) -> float:
    """The report period that keeps `num_replicas` within the controller's report budget."""
    return num_replicas / max_reports_per_s


def relay_hubs(relay_calls_per_s: float, max_calls_per_s: float, current: int = 0) -> int:
    """How many hub relays the node relays' flushes go through, so that neither the controller nor
    a hub takes more than `max_calls_per_s` of them: none while they fit the controller's budget.
    (The hubs' own calls, one per hub per flush, are few: 10 a second each.)

    A count in use (`current`) grows at once but shrinks only when the smaller count carries the
    rate with `HUB_SHRINK_SPARE` to spare: a rate near a boundary jitters by a flush or so per
    second, and every change of count sends most nodes to another hub."""
    needed = 0 if relay_calls_per_s <= max_calls_per_s else math.ceil(relay_calls_per_s / max_calls_per_s)
    if needed >= current:
        return needed
    fits = relay_calls_per_s <= (1.0 - HUB_SHRINK_SPARE) * max_calls_per_s * max(needed, 1)
    return needed if fits else current


HUB_SHRINK_SPARE = 0.2


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of unsorted `values`; None when empty.

    Nearest rank (no interpolation) so p99 of 100 samples is the 99th smallest, an observed
    TBT rather than a blend of two.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class TbtWindow:
    """TBT histograms per `slice_s` time slice, kept for `window_s` seconds.

    A window of any length up to `window_s` is the sum of the slices that overlap it: it reaches
    back to the start of the slice its start falls in (at most `slice_s` more than asked). Slices
    are dense counts (NUM_BINS ints): a report's few dozen bins add in place, slices add in C.
    """

    def __init__(self, window_s: float, slice_s: float = 1.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if slice_s <= 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        self.window_s, self.slice_s = window_s, slice_s
        self._slices: deque[tuple[float, list[int]]] = deque()  # (slice start, its counts), oldest first

    def __len__(self) -> int:
        return len(self._slices)

    def add(self, hist: LogHistogram, t: float) -> None:
        """Count `hist`'s gaps in the slice of time `t` (a clock that steps back a little adds to
        the newest slice)."""
        start = math.floor(t / self.slice_s) * self.slice_s
        if not self._slices or self._slices[-1][0] < start:
            self._slices.append((start, [0] * NUM_BINS))
        hist.add_to_dense(self._slices[-1][1])

    def prune(self, now: float) -> None:
        """Drop slices that ended before the window."""
        horizon = now - self.window_s - self.slice_s
        while self._slices and self._slices[0][0] <= horizon:
            self._slices.popleft()

    def add_window(self, dense: list[int], now: float, since: float | None = None) -> None:
        """Add to `dense` (NUM_BINS counts) the gaps of the window ending at `now` (and of slices
        not ending before `since`)."""
        self.prune(now)
        start = now - self.window_s if since is None else max(since, now - self.window_s)
        for slice_start, counts in reversed(self._slices):
            if slice_start + self.slice_s <= start:
                break
            dense[:] = map(operator.add, dense, counts)

    def histogram(self, now: float, since: float | None = None) -> LogHistogram:
        dense = [0] * NUM_BINS
        self.add_window(dense, now, since)
        return LogHistogram.from_dense(dense)


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the controller knows now: live replicas' latest loads plus windowed TBT aggregates."""

    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    tbt_p50_s: float | None = None
    tbt_p99_s: float | None = None
    num_tbt_samples: int = 0
    tbt_slo_token_share: float | None = None  # fraction of windowed TBT gaps <= the SLO (see build)
    timestamp: float = 0.0
    # Demand over the window, in tokens (prompt + max_tokens) per second of requests: those the
    # replicas started serving, and those refused anywhere (door, ingress, replica queue, SLO
    # admission). Their sum is the demand the autoscaler sizes the fleet for.
    served_tps: float = 0.0
    refused_tps: float = 0.0

    @property
    def running_tokens(self) -> int:
        return sum(r.running_tokens for r in self.replicas.values())

    @property
    def waiting_tokens(self) -> int:
        return sum(r.waiting_tokens for r in self.replicas.values())

    @property
    def token_load(self) -> int:
        return self.running_tokens + self.waiting_tokens

    @classmethod
    def build(cls, loads: Mapping[str, ReplicaLoad], tbt: LogHistogram | None, tbt_slo_s: float | None,
              timestamp: float) -> ClusterSnapshot:
        """Aggregate per-replica loads and the window's TBT histogram (pure; the simulator uses it).

        p50/p99 are within `RELATIVE_ERROR` of the exact nearest-rank values; the SLO share counts
        the gaps in bins wholly within the SLO (short by at most the gaps within 2% under it).
        """
        if tbt is None or not tbt:
            return cls(dict(loads), timestamp=timestamp)
        p50, p99 = tbt.quantiles((50, 99))
        attainment = None if tbt_slo_s is None else tbt.count_le(tbt_slo_s) / tbt.count
        return cls(dict(loads), p50, p99, tbt.count, attainment, timestamp)
