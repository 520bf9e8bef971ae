"""The controller keeps the demand its sources report per deployment and hands the autoscaler
served and refused tokens/s over the window it asks for (since the last change)."""

from __future__ import annotations

import pytest

from autoscale.controller import LoadBook
from autoscale.keys import deployment_key_of, replica_key
from autoscale.demand import DemandCounts
from replicas.protocol import ReplicaLoad

pytestmark = pytest.mark.unit


def test_snapshot_carries_the_demand_of_the_asked_replicas_deployments():
    now = [1000.0]
    book = LoadBook(window_s=60.0, stale_after_s=30.0, clock=lambda: now[0])
    llm, other = deployment_key_of("llm", "LLMServer"), deployment_key_of("other", "LLMServer")
    assert llm == "SERVE_REPLICA::llm#LLMServer"
    replica = llm + "#abc"
    book.report(replica, ReplicaLoad(running_tokens=100))
    book.report(other + "#xyz", ReplicaLoad(running_tokens=100))
    for source in ("ingress:1", "door:1"):
        book.report_demand(llm, source, DemandCounts())  # baselines
    book.report_demand(other, "ingress:9", DemandCounts())
    now[0] += 10.0
    book.report_demand(llm, "ingress:1", DemandCounts(served_tokens=20_000, served_requests=20,
                                                       refused_tokens=10_000))
    book.report_demand(llm, "door:1", DemandCounts(refused_unsized=10))  # at 1,000 tokens each
    book.report_demand(other, "ingress:9", DemandCounts(refused_tokens=99_000))
    snap = book.snapshot([replica])
    assert (snap.served_tps, snap.refused_tps) == (2_000.0, 2_000.0)  # over the 10 s since the start
    assert book.snapshot([replica], since=now[0] - 5.0).refused_tps == 4_000.0
    assert book.snapshot(None).refused_tps == 2_000.0 + 9_900.0  # every deployment
    assert book.snapshot([replica], with_tbt=False).refused_tps == 0.0  # the router's: loads only
    assert replica_key(replica) == replica
