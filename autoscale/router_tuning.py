"""`RouterTuning`: every knob of the token-load router in one frozen, validated record.

Serve hands `RequestRouterConfig.request_router_kwargs` to `TokenLoadRouter.initialize_state`;
apart from the controller's address, those keywords are this record's fields and are checked
here, once (`RouterTuning.from_kwargs`). The defaults below are the only ones: the routing
functions (`autoscale.routing`) and the simulator's router adapters read theirs from this class.
Plain Python, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RANKINGS = ("token_load", "ttft", "prefix")


@dataclass(frozen=True)
class RouterTuning:
    """How the router ranks, how fresh its view of the replicas is, and how much it samples."""

    # ---- the ranking --------------------------------------------------------------------------
    ranking: str = "token_load"  # token_load | ttft | prefix (autoscale.routing's three rules)
    # Replicas ranked per request, drawn at random from the candidates (power of d choices);
    # None ranks every candidate. A fleet no larger than this is ranked whole, as before.
    sample_size: int | None = 16
    # prefix: a cached replica goes first while its token load exceeds the least loaded one's by
    # at most this share of its KV capacity (the simulator's multi-turn experiment set it).
    prefix_imbalance: float = 0.1
    # prefix: prompt prefixes the router remembers (block hash -> replica it sent them to), so
    # it asks only those replicas' sketches besides the sample; 0 turns the memory off.
    prefix_hints: int = 131072  # about two entries a live conversation
    seed: int | None = None  # the tie-breaking and sampling RNG; None: fresh entropy
    default_max_tokens: int = 0  # a request without max_tokens needs this much KV beyond its prompt
    # An HTTP request from Serve's proxy (to replicas that serve HTTP themselves) is routed before
    # its body is read: it is booked at the replicas' mean tokens per running request, or this
    # many while none runs, so a burst between two load reports spreads instead of piling up.
    unread_request_tokens: int = 256
    # ---- the controller snapshot --------------------------------------------------------------
    refresh_interval_s: float = 0.05  # fetch a fresh snapshot at most this often
    stale_after_s: float = 0.2  # older than this: the next request waits for the refresh...
    stale_wait_s: float = 0.1  # ...at most this long
    snapshot_timeout_s: float = 1.0  # a snapshot call slower than this failed
    max_snapshot_age_s: float = 2.0  # older than this: route on the router's own ledger only
    # A routed request stops counting as in flight once its replica reports this long after it.
    reflect_grace_s: float = 0.05

    def __post_init__(self) -> None:
        if self.ranking not in RANKINGS:
            raise ValueError(f"ranking must be one of {RANKINGS}, got {self.ranking!r}")
        if self.sample_size is not None and (not _is_int(self.sample_size) or self.sample_size < 2):
            raise ValueError(f"sample_size must be an int >= 2 or None, got {self.sample_size!r}")
        for name in ("prefix_hints", "default_max_tokens", "unread_request_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("snapshot_timeout_s", "max_snapshot_age_s"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")
        # 0 refreshes (and waits for) a snapshot before every decision: tests rank on what the
        # controller knows, whatever the machine's speed.
        for name in ("refresh_interval_s", "stale_after_s", "stale_wait_s", "reflect_grace_s", "prefix_imbalance"):
            if not _positive(getattr(self, name), allow_zero=True):
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RouterTuning:
        """The record from router keywords; an unknown keyword is an error, not ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown router setting(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive(x: object, allow_zero: bool = False) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or x != x:
        return False
    return x >= 0 if allow_zero else x > 0
