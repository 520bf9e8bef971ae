"""The statistics every load test reports: nearest-rank percentiles and a p50 / p99 / max spread.

`percentile` is the server's own definition (`autoscale.load`, which the replicas' p99 TBT and the
autoscaler use), not a second one: a benchmark's p99 and the p99 the server reports about itself
must mean the same thing to be compared. Nearest rank, so a p99 is an observed sample.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoscale.load import percentile

__all__ = ["percentile", "spread"]


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """`{"p50_s", "p99_s", "max_s"}` of `values` (None each when there are none)."""
    return {"p50_s": percentile(values, 50), "p99_s": percentile(values, 99),
            "max_s": max(values, default=None)}
