"""The /metrics filter keeps one application's stallfree series, and the proxy door's (node-wide),
with their HELP/TYPE lines."""

from __future__ import annotations

import pytest

from app.prometheus import app_series

pytestmark = pytest.mark.unit

NODE_A = """# HELP ray_stallfree_request_success_total Finished requests.
# TYPE ray_stallfree_request_success_total counter
ray_stallfree_request_success_total{application="llm",finished_reason="length",replica="r1"} 3.0
ray_stallfree_request_success_total{application="other",finished_reason="length",replica="r9"} 7.0
# HELP ray_stallfree_time_to_first_token_seconds TTFT.
# TYPE ray_stallfree_time_to_first_token_seconds histogram
ray_stallfree_time_to_first_token_seconds_bucket{application="llm",le="0.1"} 2.0
ray_stallfree_time_to_first_token_seconds_count{application="llm"} 3.0
ray_stallfree_time_to_first_token_seconds_sum{application="llm"} 0.5
# HELP ray_node_cpu_utilization Ray's own.
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{instance="x"} 12.0
"""
NODE_B = """# HELP ray_stallfree_request_success_total Finished requests.
# TYPE ray_stallfree_request_success_total counter
ray_stallfree_request_success_total{application="llm",finished_reason="stop",replica="r2"} 1.0
"""


def test_keeps_this_applications_series_once_per_family() -> None:
    text = app_series([NODE_A, NODE_B], "llm")
    lines = text.splitlines()
    assert lines == [
        "# HELP ray_stallfree_request_success_total Finished requests.",
        "# TYPE ray_stallfree_request_success_total counter",
        'ray_stallfree_request_success_total{application="llm",finished_reason="length",replica="r1"} 3.0',
        'ray_stallfree_request_success_total{application="llm",finished_reason="stop",replica="r2"} 1.0',
        "# HELP ray_stallfree_time_to_first_token_seconds TTFT.",
        "# TYPE ray_stallfree_time_to_first_token_seconds histogram",
        'ray_stallfree_time_to_first_token_seconds_bucket{application="llm",le="0.1"} 2.0',
        'ray_stallfree_time_to_first_token_seconds_count{application="llm"} 3.0',
        'ray_stallfree_time_to_first_token_seconds_sum{application="llm"} 0.5',
    ]


def test_an_application_with_no_series_gets_an_empty_answer() -> None:
    assert app_series([NODE_A], "nope") == ""
    assert app_series([], "llm") == ""


def test_the_proxy_doors_series_carry_no_application_and_are_kept() -> None:
    proxy = """# HELP ray_stallfree_proxy_request_limit The proxy's adaptive in-flight limit.
# TYPE ray_stallfree_proxy_request_limit gauge
ray_stallfree_proxy_request_limit{NodeAddress="10.0.0.1"} 1024.0
"""
    assert app_series([proxy, NODE_B], "llm").splitlines() == [
        "# HELP ray_stallfree_proxy_request_limit The proxy's adaptive in-flight limit.",
        "# TYPE ray_stallfree_proxy_request_limit gauge",
        'ray_stallfree_proxy_request_limit{NodeAddress="10.0.0.1"} 1024.0',
        "# HELP ray_stallfree_request_success_total Finished requests.",
        "# TYPE ray_stallfree_request_success_total counter",
        'ray_stallfree_request_success_total{application="llm",finished_reason="stop",replica="r2"} 1.0',
    ]
