"""The scaling decision: replica count from a cluster snapshot against a TBT SLO (pure).

Up (by `upscale_step`, more when the queue says so) when any of these predicts a breach:
- the window's p99 TBT is above `tbt_slo_s * upscale_margin` (with at least `min_samples`)
  while there is load (an idle cluster's old samples do not add replicas),
- queued prompt tokens per replica exceed `queued_tokens_per_replica`,
- token load per replica exceeds `token_load_per_replica` (optional capacity model),
- the fleet has refused more than `max_refused_share` of the demand for `refusal_persist_s`
  (demand: tokens per second of requests served plus refused, at the door, the ingress, a
  replica's queue or SLO admission): admission keeps TBT and queues low by refusing, so those
  signals alone never see the demand it shed. The step sizes the fleet for all of the demand at
  the replicas' measured capacity (their served rate while refusing: they are saturated),
and `upscale_cooldown_s` has passed since the last change settled.

Down by one only when the remaining `current - 1` replicas would still hold the SLO with margin:
p99 scaled by `current / (current - 1)` (load redistributed; TBT grows at most linearly with
batch tokens, so this over-predicts) is below `tbt_slo_s * downscale_margin`, or the cluster is
idle (no running or queued tokens); and queued/token load per remaining replica stays under
`margin` times its threshold; nothing was refused, and the remaining replicas would serve the
whole demand at `margin` times their capacity measured when the fleet last refused. Those conditions must hold continuously for `downscale_stable_s`,
and `downscale_cooldown_s` must have passed since the last change. The band between the up and
down thresholds is the hysteresis: inside it the count holds.

While a change is settling (Serve's target differs from the running count) the decision holds,
and the cool-downs count from when it settled, so a replica still starting is never "not enough"
twice; only persisting refusals may raise the target meanwhile (their need is counted on the
ready replicas alone). The result is clamped to [min_replicas, max_replicas].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from autoscale.load import ClusterSnapshot


AutoscaleBy = Literal["tbt_slo", "ongoing_requests"]
DEFAULT_WINDOW_S = 30.0  # the TBT window: the policy's, and a replica's own for Serve's metrics


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ScalingConfig:
    """How the engine replicas scale (`scaling:` in serve_config.yaml); the SLO it scales
    against is the engine's `tbt_slo_ms`, handed to the decision beside this record."""

    min_replicas: int = Field(1, ge=0, description="autoscaling: the fewest engine replicas")
    max_replicas: int | None = Field(None, ge=1, description=
        "autoscaling: the most engine replicas; set, it turns autoscaling on (else num_replicas)")
    by: AutoscaleBy = Field("tbt_slo", description=
        "scale against engine.tbt_slo_ms (needs it), or Serve's default request-count policy")
    target_ongoing_requests: float = Field(32.0, gt=0, description=
        "by ongoing_requests: Serve's target per replica")
    window_s: float = Field(DEFAULT_WINDOW_S, gt=0, description="sliding window of TBT gaps the p99 is taken over")
    upscale_margin: float = Field(1.0, gt=0, description="scale up when p99 TBT > SLO x this")
    downscale_margin: float = Field(0.7, gt=0, description=
        "scale down only when the remaining replicas keep p99 TBT under SLO x this (and queue and "
        "token load under this share of their thresholds); at most upscale_margin")
    upscale_cooldown_s: float = Field(5.0, ge=0, description=
        "after a scaling change settles, wait this long before scaling up again")
    downscale_cooldown_s: float = Field(30.0, ge=0, description=
        "after a scaling change settles, wait this long before scaling down")
    downscale_stable_s: float = Field(5.0, ge=0, description=
        "the scale-down conditions must hold this long without a break")
    min_samples: int = Field(20, ge=0, description="TBT gaps in the window before its p99 is trusted")
    queued_tokens_per_replica: int | None = Field(None, gt=0, description=
        "prompt tokens waiting per replica beyond which a breach is predicted (scale up); null: "
        "half of replica.max_queued_tokens (the app) or no queue rule (the decision alone)")
    token_load_per_replica: int | None = Field(None, gt=0, description=
        "token load one replica holds within the SLO (a capacity model); null: not used")
    max_refused_share: float | None = Field(0.01, ge=0, lt=1, description=
        "scale up while more than this share of the demand (tokens/s served + refused, from the "
        "door to the replicas' queues) is refused; null: refusals are not a scaling signal")
    refusal_persist_s: float = Field(2.0, ge=0, description=
        "refusals must go on this long, without a break, before they add replicas")
    within_free_devices: bool = Field(True, description=
        "ask only for replicas the cluster's free resources can place, each replica's bundles on "
        "one node (a tensor-parallel replica's GPUs together); false with a Ray cluster "
        "autoscaler that adds nodes for pending replicas")
    max_upscale_step: int = Field(4, ge=1, description="replicas added by one decision, at most")
    upscale_step: int = Field(1, ge=1, description="replicas added when only the TBT p99 says so")

    def __post_init__(self) -> None:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.downscale_margin > self.upscale_margin:
            raise ValueError(f"downscale_margin must be in (0, upscale_margin], got {self.downscale_margin}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def upper(self) -> int:
        """The most replicas the decision may ask for."""
        return max(self.max_replicas or 1, self.min_replicas, 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScalingConfig:
        """Build from a config mapping (unknown keys are an error, naming them)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown scaling config keys: {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def queued_tokens_threshold(max_queued_tokens: int) -> int:
    """The queue rule's default: half of a replica's queue cap (`ReplicaOptions.max_queued_tokens`),
    so the fleet grows well before replicas start refusing for a full queue."""
    return max_queued_tokens // 2


@dataclass(frozen=True)
class ScalingState:
    """What the decision remembers between calls (kept in Serve's policy_state as a dict)."""

    last_change_s: float | None = None  # when the last change settled (or was decided)
    down_since_s: float | None = None  # when the scale-down conditions started holding
    reason: str = "init"
    refusing_since_s: float | None = None  # when the refused share went over max_refused_share
    # Tokens/s one replica served the last time the fleet refused (saturated): its capacity.
    capacity_tps: float | None = None
    decided_s: float | None = None  # when the change now settling was decided

    def window_start(self, now: float, window_s: float, settling: bool = False) -> float:
        """Where the signals' window starts: `window_s` back, but not before the last change
        landed (its effect is what counts), nor, while one is `settling`, before it was decided."""
        anchor = (self.decided_s or self.last_change_s) if settling else self.last_change_s
        return max(now - window_s, anchor if anchor is not None else -math.inf)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ScalingState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


def refused_share(snapshot: ClusterSnapshot) -> float:
    """The share of the window's demand (tokens/s served + refused) that was refused."""
    demand = snapshot.served_tps + snapshot.refused_tps
    return snapshot.refused_tps / demand if demand > 0 else 0.0


def refusing(snapshot: ClusterSnapshot, cfg: ScalingConfig) -> bool:
    return cfg.max_refused_share is not None and refused_share(snapshot) > cfg.max_refused_share


def demand_need(snapshot: ClusterSnapshot, current: int, cfg: ScalingConfig,
                capacity_tps: float | None = None) -> int:
    """Replicas to add so the whole demand would be served at `downscale_margin` of `capacity_tps`
    a replica (default: what each serves now, their capacity while the fleet refuses): the size
    at which scaling down would not hold either, so the fleet settles there.
    `ceil(demand / (capacity x margin)) - current`, at least `upscale_step` (no measure: one step)."""
    capacity = (capacity_tps or snapshot.served_tps / max(current, 1)) * cfg.downscale_margin
    if capacity <= 0:
        return cfg.upscale_step
    demand = snapshot.served_tps + snapshot.refused_tps
    return max(cfg.upscale_step, math.ceil(demand / capacity - 1e-9) - current)


def upscale_need(snapshot: ClusterSnapshot, current: int, cfg: ScalingConfig,
                 tbt_slo_s: float, refusals_persist: bool = False,
                 capacity_tps: float | None = None) -> tuple[int, str]:
    """Replicas to add now (0: none) and why; `refusals_persist`: the fleet has refused more than
    its share of the demand for `refusal_persist_s` (the caller keeps that time)."""
    n = max(current, 1)
    steps: list[tuple[int, str]] = []
    if refusals_persist:
        steps.append((demand_need(snapshot, current, cfg, capacity_tps), "refused_demand"))
    p99 = snapshot.tbt_p99_s
    busy = snapshot.token_load > 0  # an idle cluster's old breach samples are history
    if (busy and p99 is not None and snapshot.num_tbt_samples >= cfg.min_samples
            and p99 > tbt_slo_s * cfg.upscale_margin):
        steps.append((cfg.upscale_step, "tbt_p99_over_slo"))
    if cfg.queued_tokens_per_replica is not None and snapshot.waiting_tokens / n > cfg.queued_tokens_per_replica:
        steps.append((math.ceil(snapshot.waiting_tokens / cfg.queued_tokens_per_replica) - current,
                      "queued_tokens_predict_breach"))
    if cfg.token_load_per_replica is not None and snapshot.token_load / n > cfg.token_load_per_replica:
        steps.append((math.ceil(snapshot.token_load / cfg.token_load_per_replica) - current,
                      "token_load_predicts_breach"))
    if not steps:
        return 0, ""
    step, reason = max(steps)
    return max(1, min(step, cfg.max_upscale_step)), reason


def can_shrink(snapshot: ClusterSnapshot, current: int, cfg: ScalingConfig, tbt_slo_s: float,
               capacity_tps: float | None = None) -> bool:
    """Would `current - 1` replicas still hold the SLO with `downscale_margin` to spare, and the
    demand (nothing refused; the served rate within their capacity `capacity_tps` x margin)?"""
    if current <= 1:
        return current == 1 and cfg.min_replicas == 0 and snapshot.token_load == 0
    spread = current / (current - 1)
    idle = snapshot.token_load == 0
    p99 = snapshot.tbt_p99_s
    tbt_ok = idle or (p99 is not None and snapshot.num_tbt_samples >= cfg.min_samples
                      and p99 * spread < tbt_slo_s * cfg.downscale_margin)
    queue_ok = (cfg.queued_tokens_per_replica is None or
                snapshot.waiting_tokens / (current - 1) < cfg.queued_tokens_per_replica * cfg.downscale_margin)
    load_ok = (cfg.token_load_per_replica is None or
               snapshot.token_load / (current - 1) < cfg.token_load_per_replica * cfg.downscale_margin)
    demand_ok = snapshot.refused_tps == 0 or cfg.max_refused_share is None
    if demand_ok and capacity_tps is not None and cfg.max_refused_share is not None:
        demand_ok = snapshot.served_tps / (current - 1) < capacity_tps * cfg.downscale_margin
    return tbt_ok and queue_ok and load_ok and demand_ok


def decide_replicas(snapshot: ClusterSnapshot, current: int, state: ScalingState, now: float,
                    cfg: ScalingConfig, tbt_slo_s: float, target: int | None = None,
                    placeable: int | None = None) -> tuple[int, ScalingState]:
    """Desired replica count and the new state against the SLO `tbt_slo_s` (seconds); `target`
    is the count a change is heading to; `placeable`: replicas the cluster's free devices can
    still hold beyond those (`autoscale.placement`; None: not bounded). An upscale the devices
    cannot place is not asked for, and the reason says so (`...:no_devices`)."""
    if not tbt_slo_s > 0:
        raise ValueError(f"tbt_slo_s must be > 0, got {tbt_slo_s!r}")
    lo, hi = cfg.min_replicas, cfg.upper
    if placeable is not None:
        # never below a target already asked for (its replicas may hold their devices already)
        hi = max(lo, min(hi, max(current, target or 0) + placeable))
    decided = state.decided_s if state.reason == "settling" else state.last_change_s
    refusing_since, capacity, persist = _refusals(snapshot, current, state, now, cfg, decided)
    if target is not None and target != current:
        # A change is settling: hold its target, the cool-downs start once it lands. Only the
        # refused demand may raise it: its need is the whole demand over the capacity, so the
        # replicas still starting are not counted twice.
        want = current + min(demand_need(snapshot, current, cfg, capacity), cfg.max_upscale_step) if persist else target
        settle = ScalingState(now, None, "settling", refusing_since, capacity, decided if decided is not None else now)
        if want > target:
            return min(want, hi), replace(settle, reason="refused_demand", decided_s=now)
        return min(max(target, lo), hi), settle
    if current < lo or current > hi:
        return min(max(current, lo), hi), ScalingState(now, None, "out_of_bounds", capacity_tps=capacity)
    since_change = math.inf if state.last_change_s is None else now - state.last_change_s
    state = replace(state, refusing_since_s=refusing_since, capacity_tps=capacity)

    add, why = upscale_need(snapshot, current, cfg, tbt_slo_s, persist, capacity)
    if add:
        if current >= hi:
            limit = "at_max" if current >= cfg.upper else "no_devices"
            return current, replace(state, down_since_s=None, reason=f"{why}:{limit}")
        if since_change < cfg.upscale_cooldown_s:
            return current, replace(state, down_since_s=None, reason=f"{why}:cooldown")
        return min(current + add, hi), ScalingState(now, None, why, refusing_since, capacity)

    if current > lo and can_shrink(snapshot, current, cfg, tbt_slo_s, capacity):
        down_since = state.down_since_s if state.down_since_s is not None else now
        if now - down_since >= cfg.downscale_stable_s and since_change >= cfg.downscale_cooldown_s:
            return current - 1, ScalingState(now, None, "slo_holds_with_fewer", capacity_tps=capacity)
        return current, replace(state, down_since_s=down_since, reason="downscale_pending")
    return current, replace(state, down_since_s=None, reason="hold")


def _refusals(snapshot: ClusterSnapshot, current: int, state: ScalingState, now: float,
              cfg: ScalingConfig, decided: float | None) -> tuple[float | None, float | None, bool]:
    """(when this spell of refusals began, a replica's capacity in tokens/s, whether the
    refusals persist). While refusing, replicas are saturated: what one serves is its capacity,
    the best seen this spell (a window that spans replicas landing divides their work by too
    many), measured anew in each spell (the requests' mix may have changed since the last).
    Refusals persist once they have gone on `refusal_persist_s`, and as long again since the
    latest decision (a window a moment old is one burst)."""
    capacity = state.capacity_tps
    if not refusing(snapshot, cfg):
        return None, capacity, False
    spell = state.refusing_since_s is not None
    since = state.refusing_since_s if spell else now
    if snapshot.served_tps > 0:
        measured = snapshot.served_tps / max(current, 1)
        capacity = max(measured, capacity or 0.0) if spell else measured
    persist = now - max(since, decided if decided is not None else -math.inf) >= cfg.refusal_persist_s
    return since, capacity, persist
