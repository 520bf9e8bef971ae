"""HAProxy's server weights from the replicas' token load (autoscale/haproxy_weights.py): least
connections on those weights picks what the token-load router would, the servers Ray names map
to their replicas, only changed weights are sent, and a failed push neither raises nor stops the
loop."""

from __future__ import annotations

import asyncio

import pytest

from app.args import AppArgs
from autoscale.haproxy_weights import (MAX_WEIGHT, Server, WeightPusher, commands, parse_servers_state,
                                       pushes_here, server_replicas, weights)
from replicas.protocol import ReplicaLoad

pytestmark = pytest.mark.unit

# `show servers state` from Ray's HAProxy with two engine replicas (serve_config.yaml, num_replicas 2).
STATE = """1
# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port srv_check_addr srv_agent_addr srv_agent_port
5 http-llm 1 SERVE_REPLICA_llm-LLMServer-qh3ypwac 127.0.0.1 2 0 1 1 1 15 3 3 6 0 0 0 - 30000 - 0 0 - - 0
5 http-llm 2 SERVE_REPLICA_llm-LLMServer-09lgyr3m 127.0.0.1 2 0 1 1 0 1 0 2 6 0 0 0 - 30001 - 0 0 - - 0
5 http-llm 3 SERVE_PROXY_ACTOR-fallback-ccdff9853ff501b47bed6fc085ac1a3dc75f98d32341158daffcd1df 127.0.0.1 2 0 1 1 9 15 3 3 6 0 0 0 - 8500 - 0 0 - - 0
"""
A, B = "llm#LLMServer#qh3ypwac", "llm#LLMServer#09lgyr3m"
SA, SB = "SERVE_REPLICA_llm-LLMServer-qh3ypwac", "SERVE_REPLICA_llm-LLMServer-09lgyr3m"


async def _state() -> str:
    return STATE


async def _value(value):  # noqa: ANN001, ANN202
    return value


def load(running: int, waiting: int = 0, tokens: int = 0) -> ReplicaLoad:
    return ReplicaLoad(num_running=running, num_waiting=waiting, running_tokens=tokens)


def leastconn(served: dict[str, int], w: dict[str, int]) -> str:
    """HAProxy's least connections: the smallest (in flight + 1) / weight (ties: the first)."""
    return min(served, key=lambda s: (served[s] + 1) / w[s])


def test_least_connections_on_the_weights_picks_the_least_token_load() -> None:
    """Three replicas holding the same number of requests but different token loads: HAProxy's
    pick is the least token-loaded one, and a burst sent before the next push goes mostly there,
    spreading once its predicted load (its own tokens a request) passes the others'."""
    loads = {"a": load(4, tokens=8000), "b": load(4, tokens=1000), "c": load(4, tokens=3000)}
    w = weights(loads)
    assert w["b"] == MAX_WEIGHT and w["a"] < w["c"] < w["b"]
    served = {s: 4 for s in loads}
    picks = []
    for _ in range(12):
        pick = leastconn(served, w)
        picks.append(pick)
        served[pick] += 1
    assert picks[0] == "b" and picks.count("b") > picks.count("c") > picks.count("a")
    # Plain least connections (equal weights) would have spread them evenly.
    assert len({leastconn({s: 4 for s in loads}, {s: 1 for s in loads})}) == 1


def test_fewer_requests_of_more_tokens_weigh_as_their_tokens() -> None:
    """Least connections alone prefers the replica with fewer requests; by token load, one long
    prompt outweighs several short ones."""
    loads = {"long": load(1, waiting=1, tokens=6000), "short": load(6, tokens=600)}
    w = weights(loads)
    assert leastconn({"long": 2, "short": 6}, w) == "short"
    assert leastconn({"long": 2, "short": 6}, {"long": 1, "short": 1}) == "long"


def test_equal_tokens_a_request_leave_least_connections_as_it_is() -> None:
    """Where every replica's requests are the same size, token load is connections times that
    size, and least connections already picks the least: the weights stay equal."""
    assert weights({"a": load(0), "b": load(0)}) == {"a": MAX_WEIGHT, "b": MAX_WEIGHT}
    assert weights({"a": load(4, tokens=4000), "b": load(0), "c": load(1, tokens=1000)}) == {
        "a": MAX_WEIGHT, "b": MAX_WEIGHT, "c": MAX_WEIGHT}


def test_a_replica_not_reported_yet_counts_as_idle() -> None:
    w = weights({"a": load(8, tokens=8000), "b": load(8, tokens=1000), "new": None})  # HAProxy knows it,
    assert w["b"] == MAX_WEIGHT and 1 <= w["a"] < w["new"] < w["b"]  # the controller not yet
    assert leastconn({"a": 8, "b": 8, "new": 0}, w) == "new"
    assert weights({"a": load(2, tokens=10**6), "b": load(200, tokens=2000)})["a"] == 1  # never 0: a server still
    assert weights({}) == {}


def test_the_weights_give_way_to_the_doors_while_one_refuses() -> None:
    """Once a replica's queue bound would refuse the fleet's mean waiting prompt, every weight is
    equal (plain least connections; each door takes what it can). Room left is not enough."""
    def queued(waiting: int, bound: int | None, tokens: int) -> ReplicaLoad:
        return ReplicaLoad(num_running=4, num_waiting=2 if waiting else 0, running_tokens=tokens - waiting,
                           waiting_tokens=waiting, queue_bound_tokens=bound)
    # Below its bound (two prompts of 500 wait, 1,000 of room left): token load ranks.
    below = weights({"a": queued(1000, 2000, 6000), "b": queued(0, 2000, 1000)})
    assert below["b"] == MAX_WEIGHT and below["a"] < MAX_WEIGHT // 2
    # Two prompts of 800 wait at a: 400 tokens of room, short of a third: equal weights.
    full = {"a": queued(1600, 2000, 6000), "b": queued(0, 2000, 1000)}
    assert weights(full) == {"a": MAX_WEIGHT, "b": MAX_WEIGHT}
    assert weights({**full, "new": None}) == {"a": MAX_WEIGHT, "b": MAX_WEIGHT, "new": MAX_WEIGHT}
    # A bound of 0 (a stalled queue) refuses once anything waits; not reported (None) never.
    assert weights({"a": queued(10, 0, 6000), "b": queued(0, 2000, 1000)})["a"] == MAX_WEIGHT
    assert weights({"a": queued(1600, None, 6000), "b": queued(0, None, 1000)})["a"] < MAX_WEIGHT // 2


def test_servers_map_to_their_replicas_by_unique_id() -> None:
    servers = [s.name for s in parse_servers_state(STATE)]
    assert server_replicas(servers, [A, B, "other#LLMServer#zzzzzzzz"]) == {SA: A, SB: B}
    assert server_replicas(servers, [A]) == {SA: A}  # the proxy's fallback server is never one


def test_the_servers_state_is_read_with_backend_name_and_weight() -> None:
    assert parse_servers_state(STATE) == [
        Server("http-llm", SA, 1, "127.0.0.1"), Server("http-llm", SB, 1, "127.0.0.1"),
        Server("http-llm", "SERVE_PROXY_ACTOR-fallback-ccdff9853ff501b47bed6fc085ac1a3dc75f98d32341158daffcd1df", 1,
               "127.0.0.1")]
    assert parse_servers_state("1\n# be_id ...\n\n") == []


def test_one_replica_a_node_pushes_the_first_by_name() -> None:
    """Of the replicas HAProxy reaches at one address (a node), the one with the smallest server
    name pushes; a replica on another node pushes for its own; one HAProxy does not know yet, or
    no election (None), as asked."""
    servers = parse_servers_state(STATE)
    assert pushes_here(servers, B) and not pushes_here(servers, A)  # ...-09lgyr3m < ...-qh3ypwac
    other = [*servers, Server("http-llm", "SERVE_REPLICA_llm-LLMServer-zzzzzzzz", 1, "10.0.0.7")]
    assert pushes_here(other, "llm#LLMServer#zzzzzzzz") and pushes_here(other, B)
    assert not pushes_here(servers, "llm#LLMServer#notyet00") and pushes_here(servers, None)


def test_only_changed_weights_are_sent_and_one_replica_is_left_alone() -> None:
    loads = {A: load(4, tokens=4000), B: load(4, tokens=1000)}
    cmds, now = commands(parse_servers_state(STATE), loads)
    assert now == weights({SA: loads[A], SB: loads[B]}) and now[SB] == MAX_WEIGHT
    assert cmds == [f"set weight http-llm/{SA} {now[SA]}", f"set weight http-llm/{SB} {MAX_WEIGHT}"]
    applied = [Server("http-llm", SA, now[SA]), Server("http-llm", SB, MAX_WEIGHT)]
    assert commands(applied, loads) == ([], now)  # nothing changed: nothing sent
    alone = [Server("http-llm", SA, 1), Server("http-llm", "SERVE_PROXY_ACTOR-fallback-x", 1)]
    assert commands(alone, loads) == ([], {})  # one replica server: nothing to choose
    assert commands(parse_servers_state(STATE), {"other#D#zzzzzzzz": load(1)}) == ([], {})  # not ours


async def test_a_push_reads_the_state_then_sends_the_changes_in_one_line() -> None:
    sent: list[str] = []

    async def send(command: str) -> str:
        sent.append(command)
        return STATE if command == "show servers state" else "\n"

    async def fetch():  # noqa: ANN202
        return {A: load(4, tokens=8000), B: load(4, tokens=1000)}

    pusher = WeightPusher(fetch, send, interval_s=0.0, me=B)
    assert await pusher.step() == 2
    assert sent[0] == "show servers state" and len(sent) == 2 and sent[1].count("set weight") == 2
    assert ";" in sent[1] and pusher.last[SB] == MAX_WEIGHT and pusher.last[SA] < MAX_WEIGHT
    state = pusher.state()
    assert state["pushes"] == 1 and state["changes"] == 2 and state["failures"] == 0 and state["interval_ms"] == 0
    assert state["pushing"] is True and state["doors_refusing"] == 0
    full = {A: ReplicaLoad(num_running=4, num_waiting=4, running_tokens=4000, waiting_tokens=4000, queue_bound_tokens=4000),
            B: load(4, tokens=1000)}
    refusing = WeightPusher(lambda: _value(full), send, interval_s=0.0, me=B)  # A's door refuses: equal weights
    assert await refusing.step() == 2 and refusing.last == {SA: MAX_WEIGHT, SB: MAX_WEIGHT}
    assert refusing.state()["doors_refusing"] == 1
    sent.clear()
    standby = WeightPusher(fetch, send, interval_s=0.0, me=A)  # the node's other replica reads, sends nothing
    assert await standby.step() == 0 and sent == ["show servers state"] and standby.state()["pushing"] is False


async def test_a_failing_push_is_counted_and_the_loop_goes_on() -> None:
    calls = {"fetch": 0}

    async def fetch():  # noqa: ANN202
        calls["fetch"] += 1
        if calls["fetch"] <= 3:
            raise ConnectionError("controller away")
        return {A: load(1), B: load(1)}

    failing = WeightPusher(fetch, lambda command: _state(), interval_s=0.0)
    with pytest.raises(ConnectionError):
        await failing.step()
    calls["fetch"] = 0

    async def send(command: str) -> str:
        return STATE

    pusher = WeightPusher(fetch, send, interval_s=0.0)
    task = asyncio.ensure_future(pusher.run())
    for _ in range(1000):
        await asyncio.sleep(0)
        if pusher.num_steps >= 2:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pusher.num_failures == 3 and pusher.num_steps >= 2 and pusher.last == {SA: MAX_WEIGHT, SB: MAX_WEIGHT}
    assert pusher.state()["last_error"] is None  # the steps since succeeded


def test_which_apps_push_weights() -> None:
    """Engine replicas serving HTTP behind HAProxy, more than one, HAProxy not asking the router,
    a token-load ranking, the interval set (250 ms by default): then they push weights."""
    base = {"model": "embedded:tiny", "ingress_in_replica": True, "num_replicas": 2}
    assert AppArgs.model_validate(base).haproxy_weight_interval_ms == 250 and AppArgs.model_validate(base).haproxy_weights()
    assert AppArgs.model_validate({"model": "embedded:tiny", "ingress_in_replica": True,
                                   "scaling": {"max_replicas": 4, "by": "ongoing_requests"}}).haproxy_weights()
    assert AppArgs.model_validate({**base, "router": "ttft"}).haproxy_weights()
    assert not AppArgs.model_validate({**base, "num_replicas": 1}).haproxy_weights()
    assert not AppArgs.model_validate({**base, "ingress_router": True}).haproxy_weights()
    assert not AppArgs.model_validate({**base, "router": "power_of_two"}).haproxy_weights()
    assert not AppArgs.model_validate({**base, "haproxy_weight_interval_ms": None}).haproxy_weights()
    assert not AppArgs.model_validate({**base, "ingress_in_replica": False}).haproxy_weights()
    with pytest.raises(ValueError):
        AppArgs.model_validate({**base, "haproxy_weight_interval_ms": 0})
