"""A serving process raises every thread to nice 0 where it may, and says so loudly where not."""

from __future__ import annotations

import logging
import os

import pytest

from replicas.serving import priority

pytestmark = pytest.mark.unit


def test_every_thread_is_raised_or_the_log_says_why(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    nice = {0: 15, 101: 15, 102: 15}
    monkeypatch.setattr(os, "listdir", lambda path: ["101", "102"])
    monkeypatch.setattr(os, "getpriority", lambda which, tid: nice[tid])

    def allowed(which: int, tid: int, value: int) -> None:
        nice[tid] = value
        nice[0] = max(nice[101], nice[102])

    monkeypatch.setattr(os, "setpriority", allowed)
    log = logging.getLogger("test.priority")
    with caplog.at_level(logging.WARNING, "test.priority"):
        assert priority.serve_at_full_priority(log, "the replica") == 0
    assert nice == {0: 0, 101: 0, 102: 0} and not caplog.records

    nice.update({0: 15, 101: 15, 102: 15})

    def refused(which: int, tid: int, value: int) -> None:
        raise PermissionError("not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    with caplog.at_level(logging.WARNING, "test.priority"):
        assert priority.serve_at_full_priority(log, "the replica") == 15
    [warning] = caplog.records
    assert "RAY_worker_niceness=0" in warning.message and "nice 15" in warning.message
