"""What a simulation measures: per-request latencies, pooled TBT, SLO shares, goodput.

TBT (time between tokens) is pooled over every decode gap of every request, the way Sarathi-Serve
reports P99 TBT. A request's gaps are taken from its token times when it finishes (numpy, off the
per-token path); tens of millions of gaps do not fit in memory at cluster scale, so they are
folded into a histogram of `bin_s` (0.1 ms) bins every million gaps. Its percentiles are named
`tbt_bucket_p99_s` etc.: the upper edge of the bin that holds the nearest-rank gap, so at most one
bin above the observed value that `loadtests.stats.percentile` would give. The largest gap and the
share of gaps within the SLO are kept exactly. Per-request percentiles are nearest-rank
(`loadtests.stats.percentile`). Finished requests leave scalars only.

SLO shares, each in [0, 1]:
- `tpot_slo_request_share` (DistServe's goodput definition): requests whose TTFT <= ttft_slo and
  whose TPOT (mean gap) <= tbt_slo, over all requests of the trace (refused or unfinished: missed).
- `max_gap_slo_request_share` asks more: the request's worst gap is <= tbt_slo.
- `tbt_slo_token_share` is per token: the share of pooled gaps <= tbt_slo.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from loadtests.harness.stats import percentile

NAN = float("nan")


class Recorder:
    """Per-request scalars (indexed by request number) and the pooled TBT histogram."""

    def __init__(self, num_requests: int, tbt_slo_s: float, ttft_slo_s: float,
                 bin_s: float = 1e-4, max_s: float = 120.0) -> None:
        n = num_requests
        self.tbt_slo_s, self.ttft_slo_s = tbt_slo_s, ttft_slo_s
        self.arrival = [NAN] * n
        self.prompt_len = [0] * n
        self.output_len = [0] * n
        self.sched_delay = [NAN] * n  # first scheduled - arrival (Sarathi's scheduling delay)
        self.ttft = [NAN] * n
        self.e2e = [NAN] * n
        self.max_gap = [NAN] * n
        self.mean_gap = [NAN] * n
        self.preemptions = [0] * n
        self.rejected = [False] * n
        self.inv_bin = 1.0 / bin_s
        self.bin_s = bin_s
        self.top = int(max_s / bin_s)
        self._chunks: list[np.ndarray] = []  # gaps not yet folded into the histogram
        self._buffered = 0
        self.hist = np.zeros(self.top, dtype=np.int64)  # gap g counts in bin int(g / bin_s)
        self.overflow: list[float] = []  # exact gaps of max_s and more
        self.num_gaps = 0
        self.num_over_slo = 0  # gaps > tbt_slo, up to the last flush
        self.gap_max = -math.inf  # the largest gap, up to the last flush
        self.num_late_start = 0  # requests whose scheduling delay exceeded late_start_s
        self.late_start_s = 2.0
        self.num_finished = 0
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.first_arrival = math.inf
        self.last_finish = 0.0

    # ---- pooled TBT -------------------------------------------------------------------------

    FLUSH_EVERY = 1 << 20

    def add_gaps(self, gaps: np.ndarray) -> None:
        self._chunks.append(gaps)
        self._buffered += len(gaps)
        if self._buffered > self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Fold buffered gaps into the histogram (and the over-SLO count)."""
        if not self._chunks:
            return
        g = np.concatenate(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self.num_gaps += len(g)
        self.num_over_slo += int((g > self.tbt_slo_s).sum())
        if len(g):
            self.gap_max = max(self.gap_max, float(g.max()))
        k = (g * self.inv_bin).astype(np.int64)
        inside = k < self.top
        self.hist += np.bincount(k[inside], minlength=self.top)
        self.overflow.extend(g[~inside].tolist())

    def tbt_bucket_percentile(self, q: float) -> float:
        """Upper edge of the bin holding the nearest-rank percentile of all gaps (exact above max_s)."""
        self.flush()
        cum = np.cumsum(self.hist)
        total = int(cum[-1]) + len(self.overflow)
        if total == 0:
            return NAN
        rank = max(1, math.ceil(q / 100.0 * total))
        idx = int(np.searchsorted(cum, rank))
        if idx < self.top:
            return (idx + 1) * self.bin_s
        return sorted(self.overflow)[rank - int(cum[-1]) - 1]

    def tbt_slo_token_share(self) -> float:
        """Share of all gaps <= tbt_slo (exact: counted before the gaps are binned)."""
        self.flush()
        return 1.0 - self.num_over_slo / self.num_gaps if self.num_gaps else NAN

    # ---- summary ----------------------------------------------------------------------------

    def summary(self, replica_seconds: float | None = None) -> dict[str, Any]:
        done = np.array([not (r or math.isnan(e)) for r, e in zip(self.rejected, self.e2e)])
        ttft = np.array(self.ttft)[done]
        tpot = np.array(self.mean_gap)[done]
        worst = np.array(self.max_gap)[done]
        delay = np.array(self.sched_delay)[done]
        e2e = np.array(self.e2e)[done]
        span = max(self.last_finish - self.first_arrival, 1e-9)
        single = np.isnan(tpot)  # one output token: no gap, TPOT trivially met
        tpot_ok = (ttft <= self.ttft_slo_s) & (single | (tpot <= self.tbt_slo_s))
        max_gap_ok = (ttft <= self.ttft_slo_s) & (single | (worst <= self.tbt_slo_s))
        n_done, n_sent = int(done.sum()), len(self.e2e)

        def pct(a: np.ndarray, q: float) -> float:
            p = percentile(a[~np.isnan(a)].tolist(), q)
            return NAN if p is None else p

        def request_share(ok: np.ndarray) -> float:
            return float(ok.sum()) / n_sent if n_sent else NAN

        out = {
            "num_requests": n_sent, "completed": n_done, "rejected": int(sum(self.rejected)),
            "duration_s": span,
            "throughput_rps": n_done / span,
            "output_tokens_per_s": self.output_tokens / span,
            "total_tokens_per_s": (self.output_tokens + self.prompt_tokens) / span,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tbt_bucket_p50_s": self.tbt_bucket_percentile(50),
            "tbt_bucket_p90_s": self.tbt_bucket_percentile(90),
            "tbt_bucket_p99_s": self.tbt_bucket_percentile(99),
            "tbt_max_s": self.gap_max if self.num_gaps else NAN,
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "sched_delay_p50_s": pct(delay, 50), "sched_delay_p99_s": pct(delay, 99),
            "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
            "tbt_slo_token_share": self.tbt_slo_token_share(),
            "tpot_slo_request_share": request_share(tpot_ok),
            "max_gap_slo_request_share": request_share(max_gap_ok),
            "goodput_rps": float(tpot_ok.sum()) / span,
            "preemptions": int(sum(self.preemptions)),
            "tbt_slo_s": self.tbt_slo_s, "ttft_slo_s": self.ttft_slo_s,
        }
        if replica_seconds is not None:
            out["replica_seconds"] = replica_seconds
        return out
