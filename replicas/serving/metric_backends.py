"""Where the engine's metrics go: Ray's metrics inside a replica (`RayBackend`), or a
prometheus_client registry (`PrometheusBackend`: tests, the controller's endpoint, anything
outside Serve). Both take a pass's many values at once (`record_many`).

A histogram through Ray is counted here, not by Ray (`GaugeHistogram`): Ray's agent rebuilds
every histogram observation a worker reports, one OpenTelemetry `record` call each at its
bucket's midpoint, so its CPU grows with the observations, and the inter-token histogram has one
per running stream per pass. Counted here and exported as gauges of the cumulative counts, a
histogram costs the agent a few series per export whatever the traffic. `app.prometheus` serves
them on the HTTP port as the histogram they are.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

FLUSH_S = 1.0  # a GaugeHistogram sets its gauges at most this often while values come in


class Metric(Protocol):
    def record(self, value: float, tags: dict[str, str]) -> None: ...

    def record_many(self, values: Sequence[float], tags: dict[str, str]) -> None:
        """Every value of a pass in one call (a histogram's per-token observations)."""

    def flush(self) -> None:
        """Export what was recorded and not yet exported (a no-op where recording exports)."""


class Backend(Protocol):
    def counter(self, name: str, doc: str, tags: Sequence[str]) -> Metric: ...
    def gauge(self, name: str, doc: str, tags: Sequence[str]) -> Metric: ...
    def histogram(self, name: str, doc: str, buckets: Sequence[float], tags: Sequence[str]) -> Metric: ...


class _Wrap:
    """`fn(value, tags)`; `bind(tags)`, when given, resolves the tags once for many values."""

    def __init__(self, fn: Any, bind: Any = None) -> None:
        self._fn, self._bind = fn, bind

    def record(self, value: float, tags: dict[str, str]) -> None:
        self._fn(value, tags)

    def record_many(self, values: Sequence[float], tags: dict[str, str]) -> None:
        if self._bind is None:
            for v in values:
                self._fn(v, tags)
            return
        observe = self._bind(tags)
        for v in values:
            observe(v)

    def flush(self) -> None:
        pass


def le_label(bound: float) -> str:
    """A bucket's `le` as Prometheus writes it (prometheus_client's own formatting)."""
    from prometheus_client.utils import floatToGoString
    return floatToGoString(bound)


def bucket_counts(bounds: Sequence[float], values: Sequence[float]) -> dict[int, int]:
    """How many of `values` fall in each bucket of the sorted upper `bounds` (index -> count):
    a value goes to the first bound >= it, as prometheus_client's `observe` puts it (a value
    above the last bound, or NaN, in none)."""
    counts: dict[int, int] = {}
    last = bounds[-1]
    for value, n in Counter(values).items():  # a pass's gaps repeat: one search per distinct value
        if value <= last:
            i = bisect_left(bounds, value)
            counts[i] = counts.get(i, 0) + n
    return counts


class _Series:
    __slots__ = ("counts", "total", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets  # per bucket, not cumulative
        self.total, self.sum = 0, 0.0


class GaugeHistogram:
    """A histogram counted in this process and exported as three gauges of its cumulative
    counts, what a Prometheus histogram's samples are: `<name>_bucket{le=...}` (the +Inf bucket
    included), `<name>_sum`, `<name>_count`; `histogram_quantile` and `rate` read them as they
    read a histogram's. The gauges are set at most every `flush_s` while values come in, and by
    `flush()` (the engine calls it when it goes idle, and every few seconds while idle). Every
    series is set at each flush, changed or not: Ray stops exporting a gauge that is not set
    for a couple of export intervals, and a histogram must not vanish while it is quiet (Ray's
    gauges here, `_RayGauge`, skip a value they already hold until Ray's export period passed)."""

    def __init__(self, gauge: Callable[[str, str, tuple[str, ...]], Any], name: str, doc: str,
                 buckets: Sequence[float], tags: Sequence[str], clock: Callable[[], float] = time.monotonic,
                 flush_s: float = FLUSH_S) -> None:
        self.bounds = list(buckets)
        self._le = [le_label(b) for b in self.bounds]  # the +Inf bucket is the count
        self._bucket = gauge(name + "_bucket", doc, (*tags, "le"))
        self._sum = gauge(name + "_sum", doc, tuple(tags))
        self._count = gauge(name + "_count", doc, tuple(tags))
        self._series: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], _Series]] = {}
        self._clock, self.flush_s = clock, flush_s
        self._flushed_at = clock()

    def record(self, value: float, tags: dict[str, str]) -> None:
        self.record_many((value,), tags)

    def record_many(self, values: Sequence[float], tags: dict[str, str]) -> None:
        if not values:
            return
        key = tuple(sorted(tags.items()))
        entry = self._series.get(key)
        if entry is None:
            entry = self._series[key] = (dict(tags), _Series(len(self.bounds)))
        series = entry[1]
        for i, n in bucket_counts(self.bounds, values).items():
            series.counts[i] += n
        series.total += len(values)
        series.sum += sum(values)
        if self._clock() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self._flushed_at = self._clock()
        for tags, series in self._series.values():
            cumulative = 0
            for le, n in zip(self._le, series.counts):
                cumulative += n
                self._bucket.set(cumulative, {**tags, "le": le})
            self._bucket.set(series.total, {**tags, "le": "+Inf"})
            self._sum.set(series.sum, tags)
            self._count.set(series.total, tags)


def export_period_s() -> float:
    """How often Ray exports a worker's metrics: `metrics_report_interval_ms`, at least 1 s
    (Ray's own floor); Ray's agent drops a gauge series not refreshed for two of these."""
    try:
        import ray
        return max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    except Exception:  # no Ray config in this process: Ray's floor
        return 1.0


class _RayGauge:
    """`set(value, tags)` on a Ray Serve gauge (Serve adds its deployment/replica tags). A value
    equal to the series' last one is not set again within `refresh_s` (Ray's export period):
    Ray exports a gauge's last value once a period whatever the sets in between, and a set costs
    ~10 us of Python and core worker (a histogram's flush is hundreds of them, most unchanged)."""

    def __init__(self, name: str, doc: str, tags: tuple[str, ...], clock: Callable[[], float] = time.monotonic,
                 refresh_s: float | None = None) -> None:
        from ray.serve.metrics import Gauge
        self._gauge = Gauge(name, doc, tag_keys=tags)
        self._clock = clock
        self.refresh_s = export_period_s() if refresh_s is None else refresh_s
        self._last: dict[tuple[tuple[str, str], ...], tuple[float, float]] = {}  # tags -> (value, set at)

    def set(self, value: float, tags: dict[str, str]) -> None:
        key, now = tuple(tags.items()), self._clock()
        last = self._last.get(key)
        if last is not None and last[0] == value and now - last[1] < self.refresh_s:
            return
        self._last[key] = (value, now)
        self._gauge.set(value, tags=tags)


class RayBackend:
    """`ray.serve.metrics`: Serve adds deployment/replica/application tags. `replay_every_s`:
    how often the engine process's records are replayed into it (`ProcessEngine`, summed in
    between): twice per Ray export period, at least every FLUSH_S."""

    def __init__(self) -> None:
        self.replay_every_s = max(FLUSH_S, export_period_s() / 2)

    def counter(self, name: str, doc: str, tags: Sequence[str]) -> Metric:
        from ray.serve.metrics import Counter
        m = Counter(name, doc, tag_keys=tuple(tags))
        return _Wrap(lambda v, t: m.inc(v, tags=t))

    def gauge(self, name: str, doc: str, tags: Sequence[str]) -> Metric:
        g = _RayGauge(name, doc, tuple(tags))
        return _Wrap(g.set)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], tags: Sequence[str]) -> Metric:
        # Ray exports a worker's gauges once a period: setting them more than twice a period
        # only costs CPU (hundreds of sets a flush); at least every FLUSH_S all the same.
        return GaugeHistogram(_RayGauge, name, doc, buckets, tags, flush_s=self.replay_every_s)


class PrometheusBackend:
    """A prometheus_client registry (it only sees its own process)."""

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client
        self.prom = prometheus_client
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()

    def _make(self, cls: Any, name: str, doc: str, tags: Sequence[str], method: str, **kw: Any) -> Any:
        m = cls(name, doc, labelnames=list(tags), registry=self.registry, **kw)
        children: dict[tuple, Any] = {}

        def child(t: dict[str, str]) -> Any:  # one labelled child per tag set, looked up once
            key = tuple(sorted(t.items()))
            c = children.get(key)
            if c is None:
                c = children[key] = m.labels(**t) if tags else m
            return c

        def bind(t: dict[str, str]) -> Any:
            return getattr(child(t), method)

        return _Wrap(lambda v, t: bind(t)(v), bind) if method != "observe" else _BulkHistogram(child)

    def counter(self, name: str, doc: str, tags: Sequence[str]) -> Metric:
        # prometheus_client appends _total to counters itself.
        return self._make(self.prom.Counter, name.removesuffix("_total"), doc, tags, "inc")

    def gauge(self, name: str, doc: str, tags: Sequence[str]) -> Metric:
        return self._make(self.prom.Gauge, name, doc, tags, "set")

    def histogram(self, name: str, doc: str, buckets: Sequence[float], tags: Sequence[str]) -> Metric:
        return self._make(self.prom.Histogram, name, doc, tags, "observe", buckets=list(buckets))


class _BulkHistogram(_Wrap):
    """A prometheus_client histogram whose `record_many` adds a pass's values at once: each
    bucket's count and the sum once, as `observe` of each value leaves them (a pass's TBT gaps:
    one per running request, most of them equal)."""

    def __init__(self, child: Any) -> None:
        super().__init__(lambda v, t: child(t).observe(v), lambda t: child(t).observe)
        self._child = child

    def record_many(self, values: Sequence[float], tags: dict[str, str]) -> None:
        c = self._child(tags)
        bounds, buckets = getattr(c, "_upper_bounds", None), getattr(c, "_buckets", None)
        if bounds is None or buckets is None or len(bounds) != len(buckets):  # another client's layout
            super().record_many(values, tags)
            return
        c._raise_if_not_observable()
        c._sum.inc(sum(values))
        for i, n in bucket_counts(bounds, values).items():
            buckets[i].inc(n)
