"""Load reports: one replica's token load, the cluster's aggregate, and a time-windowed TBT window.

A `ReplicaLoad` is what a replica pushes to the controller at iteration granularity; a
`ClusterSnapshot` is what the router and the scaling decision read back. Both are plain data
(dicts on the wire, so a report never drags a class across Ray), and nothing here imports Ray:
the simulator builds the same snapshots from its own replicas.

Token load of a replica = running tokens (KV tokens of running sequences) + waiting tokens
(prompt tokens still to prefill). That is the number routing balances and scaling predicts from.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


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
class ReplicaLoad:
    """One replica's load at `timestamp` (the replica's wall clock when it was sampled)."""

    replica_id: str
    running_tokens: int = 0
    waiting_tokens: int = 0  # prompt tokens not yet prefilled, incl. accepted-but-not-scheduled
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    num_running: int = 0  # decode batch size
    num_waiting: int = 0
    kv_usage: float = 0.0
    tbt_samples: tuple[float, ...] = ()  # TBT samples new since this replica's previous report
    iterations: int = 0  # forward passes since the previous report
    iteration_mean_s: float = 0.0
    iteration_max_s: float = 0.0
    queue_bound_tokens: int = 0  # waiting prompt tokens it admits (replicas.admission.queue_bound)
    drain_tps: float = 0.0  # waiting prompt tokens it prefills per second lately
    timestamp: float = 0.0

    @property
    def token_load(self) -> int:
        return self.running_tokens + self.waiting_tokens

    @property
    def free_kv_tokens(self) -> int:
        return self.free_blocks * self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.total_blocks * self.block_size

    @classmethod
    def from_engine_load(cls, replica_id: str, load: Any, timestamp: float,
                         tbt_samples: Sequence[float] = (), iterations: int = 0,
                         iteration_mean_s: float = 0.0, iteration_max_s: float = 0.0) -> ReplicaLoad:
        """Build from `replicas.engine.EngineLoad` or the replica's `load()` dict.

        A dict may carry `queued_tokens` (prompt tokens the replica accepted that have not
        produced a token yet, including ones still in the engine's inbox); the larger of it and
        the scheduler's `waiting_tokens` counts as waiting, because the snapshot lags intake.
        """
        get = load.get if isinstance(load, Mapping) else lambda k, d=None: getattr(load, k, d)
        waiting = max(int(get("waiting_tokens", 0) or 0), int(get("queued_tokens", 0) or 0))
        num_waiting = max(int(get("num_waiting", 0) or 0), int(get("num_queued", 0) or 0))
        return cls(
            replica_id=replica_id,
            running_tokens=int(get("running_tokens", 0) or 0),
            waiting_tokens=waiting,
            free_blocks=int(get("free_blocks", 0) or 0),
            total_blocks=int(get("total_blocks", 0) or 0),
            block_size=int(get("block_size", 16) or 16),
            num_running=int(get("num_running", 0) or 0),
            num_waiting=num_waiting,
            kv_usage=float(get("kv_usage", 0.0) or 0.0),
            tbt_samples=tuple(float(x) for x in tbt_samples),
            iterations=iterations,
            iteration_mean_s=iteration_mean_s,
            iteration_max_s=iteration_max_s,
            queue_bound_tokens=int(get("queue_bound_tokens", 0) or 0),
            drain_tps=float(get("drain_tps", 0.0) or 0.0),
            timestamp=timestamp,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tbt_samples"] = list(self.tbt_samples)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaLoad:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["tbt_samples"] = tuple(kwargs.get("tbt_samples", ()))
        return cls(**kwargs)


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the controller knows now: live replicas' latest loads plus windowed TBT aggregates."""

    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    tbt_p50_s: float | None = None
    tbt_p99_s: float | None = None
    num_tbt_samples: int = 0
    slo_attainment: float | None = None  # fraction of windowed TBT samples <= the SLO
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

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["replicas"] = {k: v.to_dict() for k, v in self.replicas.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSnapshot:
        replicas = {k: ReplicaLoad.from_dict(v) for k, v in d.get("replicas", {}).items()}
        return cls(replicas, d.get("tbt_p50_s"), d.get("tbt_p99_s"), int(d.get("num_tbt_samples", 0)),
                   d.get("slo_attainment"), float(d.get("timestamp", 0.0)))
