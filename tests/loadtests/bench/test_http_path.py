"""The HTTP-path benchmark tells the engine loop's own process apart from the replica's, and its
table sums the HTTP path two ways: proxy + ingress, and with the replica's own process added
where the engine loop ran apart (`replica.engine_process`)."""

from __future__ import annotations

import pytest

from loadtests.bench import http_path
from loadtests.load.overload.cpu import ENGINE_LOOP, role_of

pytestmark = pytest.mark.unit

KEYS = ("stream_ms_per_request", "stream_ms_per_event", "whole_ms_per_request", "refused_ms_per_request")


def cells(proxy: float, ingress: float, engine: float, loop: float) -> dict[str, float]:
    return {"proxy": proxy, "ingress": ingress, "engine": engine, "controller": 0.5, "ray": 1.0, ENGINE_LOOP: loop}


def test_the_engine_loop_is_a_role_of_its_own() -> None:
    assert http_path.ROLES[-1] == ENGINE_LOOP and "engine" in http_path.ROLES
    child = "/venv/bin/python3 -c from replicas.serving.engine_process import child_main; child_main(5)"
    assert role_of(child, split_engine=True) == ENGINE_LOOP


def test_the_table_adds_the_replicas_own_process_only_where_the_loop_ran_apart() -> None:
    results = {"baseline": {k: cells(6.0, 12.0, 140.0, 0.0) for k in KEYS},
               "current": {k: cells(0.2, 0.0, 4.8, 130.0) for k in KEYS}}
    rows = http_path.table(results).splitlines()
    assert rows[0].endswith("| proxy + ingress | + the replica's own process |")
    baseline = next(r for r in rows if r.startswith("| baseline | stream ms_per_request"))
    current = next(r for r in rows if r.startswith("| current | stream ms_per_request"))
    assert baseline.endswith("| 18.000 | - |")  # the loop in the replica's process: no split
    assert current.endswith("| 0.200 | 5.000 |")
    assert ("stream_ms_per_request: proxy + ingress after / before = 0.011; with the replica's own process "
            "0.278") in rows
    results["baseline"] = {k: cells(0.2, 0.0, 4.0, 120.0) for k in KEYS}  # the loop apart on both sides
    assert ("stream_ms_per_request: proxy + ingress after / before = 1.000; with the replica's own process "
            "1.190") in http_path.table(results).splitlines()
