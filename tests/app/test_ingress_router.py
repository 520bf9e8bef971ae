"""HAProxy mode can keep the app's router (`ingress_router: true`): HAProxy asks the ingress
request router (`app.ingress_router`) which engine replica serves a request, the router answers
with the choice of the engine deployment's own router (costing the request from its body when
HAProxy forwards one), and the builder attaches it only where asked and there is a choice."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from ray.serve.exceptions import DeploymentUnavailableError

from app import builder, ingress_router
from app.args import AppArgs
from app.ingress_router import UNREAD, IngressRouter, NoReplica, ReplicaChoice, route_answer, routing_args
from autoscale.routing import request_cost

pytestmark = pytest.mark.unit


def test_a_completion_body_costs_its_prompt_and_its_tokens_to_come() -> None:
    args = routing_args(orjson.dumps({"model": "m", "prompt": "x" * 400, "max_tokens": 50, "n": 2}))
    assert args == ("x" * 400, {"max_tokens": 50, "n": 2})
    cost = request_cost(args, {})
    assert (cost.tokens, cost.kv_tokens) == (100, 100 + 2 * 50)  # 4 characters a token
    ids = routing_args(orjson.dumps({"prompt": [5, 6, 7], "max_completion_tokens": 9}))
    assert ids == ([5, 6, 7], {"max_tokens": 9, "n": 1})


def test_a_chat_body_costs_the_text_of_its_messages() -> None:
    body = {"messages": [{"role": "system", "content": "abcd"},
                         {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "image_url"}]},
                         "not a message"]}
    prompt, params = routing_args(orjson.dumps(body))
    assert prompt == "abcdefgh" and params == {"max_tokens": None, "n": 1}
    assert request_cost((prompt, params), {}, default_max_tokens=16).kv_tokens == 2 + 16


@pytest.mark.parametrize("body", [b"", b"{not json", b'{"prompt": "abc', b"[1, 2]", b'{"messages": []}',
                                  b'{"model": "m"}'])
def test_no_body_or_no_prompt_routes_as_a_body_unread(body: bytes) -> None:
    """Not forwarded (Ray's default), cut at HAProxy's buffer, or odd: the router costs it as
    Serve's proxy costs a request it has not read."""
    assert routing_args(body) == (UNREAD,)
    assert isinstance(UNREAD, bytes)  # what TokenLoadRouter._cost takes for a body unread


def test_the_answer_names_the_replica_and_its_own_server() -> None:
    assert route_answer("SERVE_REPLICA::llm#LLMServer#ab", ("10.0.0.2", 30001)) == {
        "host": "10.0.0.2", "port": 30001, "replica_id": "SERVE_REPLICA::llm#LLMServer#ab"}
    with pytest.raises(RuntimeError, match="no HTTP server"):
        route_answer("SERVE_REPLICA::llm#LLMServer#ab", None)


class FakeHandle:
    """`choose_replica` as Serve's handle offers it: an async context yielding a selection."""

    def __init__(self, endpoint: tuple[str, int] | None = ("127.0.0.1", 30002), error: Exception | None = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.endpoint, self.error = endpoint, error

    @contextlib.asynccontextmanager
    async def _choose(self) -> AsyncIterator[Any]:
        if self.error is not None:
            raise self.error
        replica = SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: "SERVE_REPLICA::llm#LLMServer#r1"),
                                  backend_http_endpoint=self.endpoint)
        yield SimpleNamespace(_replica=replica)

    def choose_replica(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self._choose()


async def test_the_handle_chooses_without_reserving_a_slot_and_answers_are_counted() -> None:
    handle = FakeHandle()
    choice = ReplicaChoice(handle)
    answer = await choice.answer(orjson.dumps({"prompt": [1, 2], "max_tokens": 3}))
    assert answer == {"host": "127.0.0.1", "port": 30002, "replica_id": "SERVE_REPLICA::llm#LLMServer#r1"}
    assert handle.calls == [(([1, 2], {"max_tokens": 3, "n": 1}), {"_reserve": False})]
    await choice.answer(b"")
    assert handle.calls[1] == ((UNREAD,), {"_reserve": False})
    assert choice.routed == 2


@pytest.mark.parametrize("handle", [FakeHandle(endpoint=None), FakeHandle(error=DeploymentUnavailableError("llm"))])
async def test_no_replica_to_name_is_no_answer(handle: FakeHandle) -> None:
    """(IngressRouter answers it 503; HAProxy answers any non-200 with a 503 of its own.)"""
    choice = ReplicaChoice(handle)
    with pytest.raises(NoReplica):
        await choice.answer(b"")
    assert choice.routed == 0


def _haproxy(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(builder, "proxy_kind", lambda: "haproxy" if on else "serve")


@pytest.mark.parametrize(("args", "choice"), [({"ingress_router": True}, False),
                                              ({"ingress_router": True, "num_replicas": 2}, True),
                                              ({"ingress_router": True, "scaling": {"min_replicas": 1, "max_replicas": 3}}, True),
                                              ({"num_replicas": 2}, False)])  # opt-in: least connections
def test_haproxy_mode_asks_the_router_where_asked_and_there_is_a_choice(monkeypatch: pytest.MonkeyPatch,
                                                                        args: dict, choice: bool) -> None:
    _haproxy(monkeypatch, True)
    app_args = AppArgs(ingress_in_replica=True, engine={"tbt_slo_ms": 200}, **args)
    options = builder.replica_ingress_options(app_args)
    assert ("request_router_config" in options) is choice
    router = build = builder.build_app(app_args)._ingress_request_router
    if not choice:
        assert router is None  # HAProxy forwards by least connections (or to its one replica)
        return
    deployment = build._bound_deployment
    assert deployment.func_or_class is IngressRouter
    assert deployment.name == ingress_router.INGRESS_ROUTER_DEPLOYMENT and deployment.num_replicas == 1
    assert deployment.ray_actor_options["num_cpus"] == 0
    env = deployment.ray_actor_options["runtime_env"]["env_vars"]  # one event loop: no thread hops per call
    assert env == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    [replicas] = deployment.init_args  # a handle to the engine replicas, bound
    assert replicas._bound_deployment.func_or_class is builder.ReplicaIngress
    assert options["request_router_config"].request_router_class.endswith("TokenLoadRouter")


def test_serve_s_proxy_routes_itself_and_needs_no_ingress_router(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    _haproxy(monkeypatch, False)
    app = builder.build_app(AppArgs(ingress_in_replica=True, num_replicas=3, ingress_router=True))
    assert app._ingress_request_router is None
    assert "ingress_router is for Ray's HAProxy mode" in caplog.text  # said, not silently ignored
    assert "request_router_config" in builder.replica_ingress_options(AppArgs(ingress_in_replica=True))


def test_the_ingress_router_needs_engine_replicas_serving_http() -> None:
    with pytest.raises(ValueError, match="ingress_router is HAProxy's way"):
        AppArgs(ingress_router=True)
