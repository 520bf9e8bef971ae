"""Errors keep their meaning across Ray: a gone client is INFO (not a fault), a dead replica is a
503 `engine_unavailable` with retry advice, backpressure is a 429, long input is not echoed."""

from __future__ import annotations

import logging

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from app.errors import ENGINE_RETRY_AFTER_S, MAX_MESSAGE_CHARS, OpenAIError, from_exception

pytestmark = pytest.mark.unit


def test_a_client_that_went_away_is_info_not_a_server_fault(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="app.errors"):
        err = from_exception(RequestCancelledError("r-1"))
    assert err.status_code == 499 and err.code == "client_disconnected"
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "client disconnected" in caplog.records[0].getMessage()


def test_a_dead_replica_is_503_engine_unavailable_with_retry_advice() -> None:
    err = from_exception(ActorDiedError())
    assert err.status_code == 503 and err.code == "engine_unavailable"
    assert err.body()["error"]["type"] == "server_error"
    assert err.headers["Retry-After"] == str(ENGINE_RETRY_AFTER_S) and "retry" in err.message


def test_backpressure_is_429() -> None:
    err = from_exception(BackPressureError(num_queued_requests=8, max_queued_requests=8))
    assert err.status_code == 429 and err.headers["Retry-After"] == "1"


def test_an_unknown_failure_is_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="app.errors"):
        err = from_exception(KeyError("x"))
    assert err.status_code == 500 and "KeyError" in err.message
    assert [r.levelno for r in caplog.records] == [logging.ERROR]


def test_messages_are_truncated() -> None:
    err = OpenAIError(400, "stop: " + "x" * 100_000)
    assert len(err.message) <= MAX_MESSAGE_CHARS + 40
    assert err.message.endswith(f"({100_006 - MAX_MESSAGE_CHARS} more characters)")
