"""`--set` writes app settings the way serve_config.yaml nests them."""

from __future__ import annotations

import pytest

from app.args import AppArgs
from loadtests.harness import serve_local
from loadtests.harness.serve_local import merge_args, parse_sets, wait_direct

pytestmark = pytest.mark.unit


def test_dotted_sets_fill_nested_records_and_merge() -> None:
    sets = parse_sets(["model=embedded:tiny", "engine.policy=dynamic", "engine.max_num_seqs=4",
                       'replica={"max_queued_tokens": 64}', "replica.stream_interval_ms=0", "num_cpus=0.5"])
    assert sets == {"model": "embedded:tiny", "engine": {"policy": "dynamic", "max_num_seqs": 4},
                    "replica": {"max_queued_tokens": 64, "stream_interval_ms": 0}, "num_cpus": 0.5}
    args = AppArgs.model_validate(merge_args({"engine": {"queue_timeout_s": 10}}, sets))
    assert (args.engine.policy, args.engine.max_num_seqs, args.engine.queue_timeout_s) == ("dynamic", 4, 10)
    with pytest.raises(ValueError, match="key=value"):
        parse_sets(["engine.policy"])


class _Health:
    def __init__(self, body: dict) -> None:
        self._body = body

    def json(self) -> dict:
        return self._body


def test_haproxy_mode_waits_for_the_replicas_own_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until HAProxy has seen a replica's own server healthy, Ray's fallback Python proxy serves:
    the harness waits that out; any other path is served at once."""
    fallback = {"http_path": {"proxy": "haproxy", "door": "proxy"}}
    direct = {"http_path": {"proxy": "haproxy", "door": "ingress"}}
    answers = iter([fallback, fallback, direct])
    asked: list[str] = []
    monkeypatch.setattr(serve_local.time, "sleep", lambda s: None)
    monkeypatch.setattr(serve_local.httpx, "get", lambda url, timeout: asked.append(url) or _Health(next(answers)))
    assert wait_direct("http://h:1", fallback) == direct and asked == ["http://h:1/health"] * 3
    serve = {"http_path": {"proxy": "serve", "door": "proxy"}}
    assert wait_direct("http://h:1", serve) is serve and len(asked) == 3
    assert wait_direct("http://h:1", {"status": "ok"}) == {"status": "ok"}  # the launcher's own path
    with pytest.raises(TimeoutError, match="fallback proxy"):
        wait_direct("http://h:1", fallback, timeout_s=-1)
