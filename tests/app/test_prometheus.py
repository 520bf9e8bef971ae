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


GAUGE_HISTOGRAM = """# HELP ray_stallfree_inter_token_latency_seconds_sum TBT.
# TYPE ray_stallfree_inter_token_latency_seconds_sum gauge
ray_stallfree_inter_token_latency_seconds_sum{application="llm",model_name="m",replica="r1"} 0.25
# HELP ray_stallfree_inter_token_latency_seconds_bucket TBT.
# TYPE ray_stallfree_inter_token_latency_seconds_bucket gauge
ray_stallfree_inter_token_latency_seconds_bucket{application="llm",le="+Inf",model_name="m",replica="r1"} 5.0
ray_stallfree_inter_token_latency_seconds_bucket{application="llm",le="0.1",model_name="m",replica="r1"} 4.0
ray_stallfree_inter_token_latency_seconds_bucket{application="llm",le="0.01",model_name="m",replica="r1"} 1.0
ray_stallfree_inter_token_latency_seconds_bucket{application="other",le="0.01",model_name="m",replica="r9"} 1.0
# HELP ray_stallfree_inter_token_latency_seconds_count TBT.
# TYPE ray_stallfree_inter_token_latency_seconds_count gauge
ray_stallfree_inter_token_latency_seconds_count{application="llm",model_name="m",replica="r1"} 5.0
"""


def test_a_histogram_exported_as_gauges_is_served_as_the_histogram_it_is() -> None:
    """The replica's counted histogram reaches Ray's export as three gauges (`_bucket`, `_sum`,
    `_count`); /metrics serves them as one histogram family, buckets in `le` order, which a
    Prometheus parser reads as a histogram with the counts the replica kept."""
    from prometheus_client.parser import text_string_to_metric_families

    text = app_series([GAUGE_HISTOGRAM, NODE_B], "llm")
    lines = text.splitlines()
    name = "ray_stallfree_inter_token_latency_seconds"
    assert lines[:2] == [f"# HELP {name} TBT.", f"# TYPE {name} histogram"]
    assert [line.split("le=")[1].split('"')[1] for line in lines[2:5]] == ["0.01", "0.1", "+Inf"]
    assert lines[5].startswith(name + "_sum") and lines[6].startswith(name + "_count")
    [family] = [f for f in text_string_to_metric_families(text) if f.name == name]
    assert family.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert got == {(name + "_bucket", "0.01"): 1.0, (name + "_bucket", "0.1"): 4.0, (name + "_bucket", "+Inf"): 5.0,
                   (name + "_sum", None): 0.25, (name + "_count", None): 5.0}
    # a lone gauge named *_bucket (no _sum/_count beside it) stays the gauge it is
    lone = GAUGE_HISTOGRAM.split("# HELP ray_stallfree_inter_token_latency_seconds_count")[0]
    assert f"# TYPE {name}_bucket gauge" in app_series([lone], "llm")
