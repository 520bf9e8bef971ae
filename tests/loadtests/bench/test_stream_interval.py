"""The stream-interval benchmark's client (loadtests/bench/stream_interval.py) against a live
app: every streaming request and every probe is answered and counted."""

from __future__ import annotations

import asyncio

import pytest

from loadtests.bench.stream_interval import _mix

pytestmark = pytest.mark.serve


def test_the_benchmark_client_counts_chunks_and_probes(serve_app) -> None:  # noqa: ANN001 - tests/conftest.py
    row = asyncio.run(_mix(serve_app.base_url, rate=2, duration_s=1.0, max_tokens=8, probe_rate=2))
    assert row["status"] == {200: 2} and row["chunks"] >= 2
    assert row["ttft_p50_s"] > 0 and row["probe_p50_s"] > 0
