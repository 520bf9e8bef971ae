"""/health's `http_path` names the proxy that serves HTTP and where the door runs, from what this
process's Serve was started with; asking never starts Ray."""

from __future__ import annotations

import pytest

from app import http_path

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("ha", "direct", "kind"), [(True, True, "haproxy"), (False, True, "direct"),
                                                    (False, False, "serve")])
def test_the_proxy_kind_follows_serves_switches(monkeypatch: pytest.MonkeyPatch, ha: bool, direct: bool,
                                                kind: str) -> None:
    from ray.serve._private import constants

    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", ha)
    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", direct)
    assert http_path.proxy_kind() == kind


def test_outside_a_serve_replica_the_door_runs_in_a_proxy_and_ray_stays_down() -> None:
    import ray

    was_up = ray.is_initialized()  # the session's Ray, when serve-tier tests ran before
    assert http_path.runs_in() == "proxy"
    assert ray.is_initialized() == was_up  # not started by asking (the runtime context would)
