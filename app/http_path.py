"""Which HTTP path serves the app: Ray's HAProxy mode (a C proxy holding the port, each ingress
replica serving HTTP itself) or Serve's Python proxy (relaying every request and streamed event to
an ingress over Ray), and in which process the door runs. serve_config.yaml leaves HAProxy mode
off (opt-in); the reasons, measured: docs/architecture.md, "The HTTP path"."""

from __future__ import annotations

HA_PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"  # Ray's switch, read once where Serve is imported
REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"  # how Serve names a replica's actor


def proxy_kind() -> str:
    """Which proxy serves HTTP, as this process's Serve sees it: "haproxy", "direct" (the
    ingress replicas' own servers alone) or "serve" (Serve's Python proxy)."""
    from ray.serve._private import constants

    if constants.RAY_SERVE_ENABLE_HA_PROXY:
        return "haproxy"
    return "direct" if constants.RAY_SERVE_ENABLE_DIRECT_INGRESS else "serve"


def runs_in() -> str:
    """Where this process serves the door: "ingress" (an ingress replica's own HTTP server) or
    "proxy" (Serve's Python proxy, and anywhere outside Ray)."""
    try:
        import ray

        # Asked outside a Ray worker, the runtime context would start a Ray instance.
        name = (ray.get_runtime_context().get_actor_name() or "") if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no Ray (unit tests)
        return "proxy"
    # By the actor's name: Serve may start a replica's server before its replica context is set.
    return "ingress" if name.startswith(REPLICA_ACTOR_PREFIX) else "proxy"
