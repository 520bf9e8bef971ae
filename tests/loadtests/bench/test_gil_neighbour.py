"""The GIL-neighbour benchmark times real decode passes under each neighbour, from one fresh
batch each time, and its neighbours stop when told."""

from __future__ import annotations

import threading
import time

import pytest

from loadtests.bench.gil_neighbour import CASES, busy_loop, run, table

pytestmark = pytest.mark.engine


def test_every_case_times_its_passes() -> None:
    results = run("embedded:tiny", decodes=4, steps=5, busy=0.3, rounds=1)
    assert set(results) == set(CASES)
    for case in CASES:
        r = results[case]
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and len(r["rounds"]) == 1
    assert table(results).splitlines()[1].startswith("alone")


def test_the_neighbour_stops_when_told() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=busy_loop, args=(stop, 0.5))
    worker.start()
    time.sleep(0.3)
    stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive()
