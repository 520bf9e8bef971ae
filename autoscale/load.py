"""The cluster's view of load: the aggregate of replica loads and a time-windowed TBT window.

A replica pushes its `replicas.protocol.ReplicaLoad` (the one load record, built by its
scheduler) to the controller at iteration granularity; a `ClusterSnapshot` is what the router,
the door's admission and the scaling decision read back. Both are plain frozen dataclasses,
pickled as they are across Ray, and nothing here imports Ray: the simulator builds the same
snapshots from its own replicas.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from replicas.protocol import ReplicaLoad

__all__ = ["MAX_PENDING_SAMPLES", "ClusterSnapshot", "ReplicaLoad", "ReportThrottle", "SlidingWindow",
           "percentile"]

MAX_PENDING_SAMPLES = 2048  # TBT samples a replica keeps between two load reports, at most


@dataclass(frozen=True)
class ReportThrottle:
    """When a replica sends its next load report: every `interval_s`, sooner (but not within
    `min_interval_s`) when its token load moved by `change_tokens` or `change_fraction` of the
    last reported load. The reporter's rule, and the simulator's."""

    interval_s: float = 0.1
    min_interval_s: float = 0.02
    change_tokens: int = 256
    change_fraction: float = 0.25

    def due(self, elapsed_s: float, token_change: int, last_tokens: int) -> bool:
        elapsed = elapsed_s + 1e-9  # float clocks: 0.3 - 0.2 < 0.1
        if elapsed >= self.interval_s:
            return True
        jump = abs(token_change) >= max(self.change_tokens, self.change_fraction * last_tokens)
        return jump and elapsed >= self.min_interval_s


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


class SlidingWindow:
    """Timestamped samples kept for `window_s` seconds (at most `max_samples`, oldest dropped)."""

    def __init__(self, window_s: float, max_samples: int = 4096) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_samples <= 0:
            raise ValueError(f"max_samples must be > 0, got {max_samples}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (t, value)

    def __len__(self) -> int:
        return len(self._samples)

    def extend(self, values: Iterable[float], t: float) -> None:
        """Add samples observed at time `t` (timestamps must not go backwards much)."""
        self._samples.extend((t, float(v)) for v in values)

    def prune(self, now: float) -> None:
        """Drop samples older than the window."""
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def values(self, now: float, since: float | None = None) -> list[float]:
        """Samples inside the window ending at `now` (and not older than `since`)."""
        self.prune(now)
        start = now - self.window_s if since is None else max(since, now - self.window_s)
        return [v for t, v in self._samples if t >= start]

    def percentile(self, q: float, now: float, since: float | None = None) -> float | None:
        return percentile(self.values(now, since), q)


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the controller knows now: live replicas' latest loads plus windowed TBT aggregates."""

    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    tbt_p50_s: float | None = None
    tbt_p99_s: float | None = None
    num_tbt_samples: int = 0
    tbt_slo_token_share: float | None = None  # fraction of windowed TBT samples (gaps) <= the SLO
    timestamp: float = 0.0

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
    def build(cls, loads: Mapping[str, ReplicaLoad], tbt_samples: Sequence[float],
              tbt_slo_s: float | None, timestamp: float) -> ClusterSnapshot:
        """Aggregate per-replica loads and the window's TBT samples (pure; the simulator uses it)."""
        attainment = None
        if tbt_slo_s is not None and tbt_samples:
            attainment = sum(1 for x in tbt_samples if x <= tbt_slo_s) / len(tbt_samples)
        return cls(dict(loads), percentile(tbt_samples, 50), percentile(tbt_samples, 99),
                   len(tbt_samples), attainment, timestamp)
