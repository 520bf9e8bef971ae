"""The numbers of one phase: counts by category, accepted latencies, what the refusals looked like."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from loadtests.load.overload.records import CATEGORIES, Rec, classify
from loadtests.harness.stats import percentile, spread


def counts(recs: Sequence[Rec]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for r in recs:
        out[classify(r)] += 1
    return out


def accepted_ttfts(recs: Sequence[Rec]) -> list[float]:
    """TTFT of every 200; one that never got a first token counts with how long it waited."""
    out: list[float] = []
    for r in recs:
        if r.status == 200:
            t = r.ttft_s if r.ttft_s is not None else r.end_s
            if t is not None:
                out.append(t)
    return out


def refusals_by_source(rejected: Sequence[Rec]) -> dict[str, dict[str, Any]]:
    """Per bound that answered: how many 429s, their latency p50 / p99 / max."""
    groups: dict[str, list[float]] = {}
    for r in rejected:
        if r.headers_s is not None:
            groups.setdefault(r.refused_by or "other", []).append(r.headers_s)
    return {who: {"n": len(lat), **spread(lat)} for who, lat in sorted(groups.items(), key=lambda kv: -len(kv[1]))}


def summarize(recs: Sequence[Rec], window_s: float) -> dict[str, Any]:
    """Counts by category, latencies of accepted requests, and what the rejections looked like."""
    by = counts(recs)
    gaps = [g for r in recs if r.status == 200 for g in r.gaps]
    arrival_gaps = [g for r in recs if r.status == 200 for g in r.arrival_gaps]
    ttft = accepted_ttfts(recs)
    rejected = [r for r in recs if r.status == 429]
    non200 = [r for r in recs if r.status is not None and r.status != 200]
    lat429 = [r.headers_s for r in rejected if r.headers_s is not None]
    arrival429 = [r.headers_arrival_s for r in rejected if r.headers_arrival_s is not None]
    lag = spread([r.send_lag_s for r in recs])
    return {
        "sent": len(recs), "window_s": window_s,
        "offered_req_s": len(recs) / window_s if window_s > 0 else 0.0,
        "counts": by, "completed_ratio": by["ok"] / len(recs) if recs else 0.0,
        "accepted": sum(r.status == 200 for r in recs),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft, default=None),
        "tbt_p50_s": percentile(gaps, 50), "tbt_p99_s": percentile(gaps, 99),
        "tbt_max_s": max(gaps, default=None), "num_gaps": len(gaps),
        "tbt_arrival_p50_s": percentile(arrival_gaps, 50), "tbt_arrival_p99_s": percentile(arrival_gaps, 99),
        "headers_200_p99_s": percentile([r.headers_s for r in recs
                                         if r.status == 200 and r.headers_s is not None], 99),
        "reject_p50_s": percentile(lat429, 50), "reject_p99_s": percentile(lat429, 99),
        "reject_max_s": max(lat429, default=None),
        "reject_arrival_p50_s": percentile(arrival429, 50), "reject_arrival_p99_s": percentile(arrival429, 99),
        "reject_by": refusals_by_source(rejected),
        "reject_retry_after": sum(bool(r.retry_after) for r in rejected),
        "reject_openai_body": sum(bool(r.openai_body) for r in rejected),
        "non_json_error_bodies": sum(r.json_body is False for r in non200),
        "non_openai_error_bodies": sum(not r.openai_body for r in non200),
        "status_codes": _status_codes(recs),
        "transport_errors": _transport_errors(recs),
        "send_lag_p50_s": lag["p50_s"], "send_lag_p99_s": lag["p99_s"], "send_lag_max_s": lag["max_s"],
    }


def _status_codes(recs: Sequence[Rec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        key = str(r.status) if r.status is not None else "none"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _transport_errors(recs: Sequence[Rec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r.exc:
            out[r.exc] = out.get(r.exc, 0) + 1
    return out


def probe_summary(samples: Sequence[tuple[float, int | None, float]]) -> dict[str, Any]:
    """The door probe's answers: how many of each status, the 429s' latency p50 / p99 / max."""
    lat429 = [lat for _, status, lat in samples if status == 429]
    codes = Counter(str(status) for _, status, _ in samples)
    lag = spread(lat429)
    return {"sent": len(samples), "status_codes": dict(codes), "n429": len(lat429),
            "reject_p50_s": lag["p50_s"], "reject_p99_s": lag["p99_s"], "reject_max_s": lag["max_s"]}
