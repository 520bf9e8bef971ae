"""The scaling decision: replica count from a cluster snapshot against a TBT SLO (pure).

Up (by `upscale_step`, more when the queue says so) when any of these predicts a breach:
- the window's p99 TBT is above `tbt_slo_s * upscale_margin` (with at least `min_samples`)
  while there is load (an idle cluster's old samples do not add replicas),
- queued prompt tokens per replica exceed `queued_tokens_per_replica`,
- token load per replica exceeds `token_load_per_replica` (optional capacity model),
and `upscale_cooldown_s` has passed since the last change settled.

Down by one only when the remaining `current - 1` replicas would still hold the SLO with margin:
p99 scaled by `current / (current - 1)` (load redistributed; TBT grows at most linearly with
batch tokens, so this over-predicts) is below `tbt_slo_s * downscale_margin`, or the cluster is
idle (no running or queued tokens); and queued/token load per remaining replica stays under
`margin` times its threshold. Those conditions must hold continuously for `downscale_stable_s`,
and `downscale_cooldown_s` must have passed since the last change. The band between the up and
down thresholds is the hysteresis: inside it the count holds.

While a change is settling (Serve's target differs from the running count) the decision holds,
and the cool-downs count from when it settled, so a replica still starting is never "not enough"
twice. The result is clamped to [min_replicas, max_replicas].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from autoscale.load import ClusterSnapshot


@dataclass(frozen=True)
class ScalingConfig:
    """Scaling knobs; the SLO, window and margins come from the app config."""

    tbt_slo_s: float
    window_s: float = 30.0  # sliding window of TBT samples the p99 is taken over
    min_replicas: int = 1
    max_replicas: int = 1
    upscale_margin: float = 1.0  # scale up when p99 > slo * upscale_margin
    downscale_margin: float = 0.7  # scale down only if predicted p99 < slo * downscale_margin
    upscale_cooldown_s: float = 5.0  # since the last change settled
    downscale_cooldown_s: float = 30.0
    downscale_stable_s: float = 5.0  # down conditions must hold this long without a break
    min_samples: int = 20  # TBT samples needed before the p99 is trusted
    queued_tokens_per_replica: int | None = 4096  # queue beyond this predicts a breach
    token_load_per_replica: int | None = None  # token load one replica holds within the SLO
    max_upscale_step: int = 4
    upscale_step: int = 1

    def __post_init__(self) -> None:
        def positive(name: str, value: float | int | None, allow_zero: bool = False) -> None:
            if value is not None and not (value >= 0 if allow_zero else value > 0):
                raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")

        positive("tbt_slo_s", self.tbt_slo_s)
        positive("window_s", self.window_s)
        positive("min_replicas", self.min_replicas, allow_zero=True)
        positive("max_replicas", self.max_replicas)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        positive("upscale_margin", self.upscale_margin)
        if not 0 < self.downscale_margin <= self.upscale_margin:
            raise ValueError(f"downscale_margin must be in (0, upscale_margin], got {self.downscale_margin}")
        for name in ("upscale_cooldown_s", "downscale_cooldown_s", "downscale_stable_s", "min_samples"):
            positive(name, getattr(self, name), allow_zero=True)
        positive("queued_tokens_per_replica", self.queued_tokens_per_replica)
        positive("token_load_per_replica", self.token_load_per_replica)
        positive("max_upscale_step", self.max_upscale_step)
        positive("upscale_step", self.upscale_step)

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


@dataclass(frozen=True)
class ScalingState:
    """What the decision remembers between calls (kept in Serve's policy_state as a dict)."""

    last_change_s: float | None = None  # when the last change settled (or was decided)
    down_since_s: float | None = None  # when the scale-down conditions started holding
    reason: str = "init"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ScalingState:
        d = d or {}
        return cls(d.get("last_change_s"), d.get("down_since_s"), d.get("reason", "init"))


def upscale_need(snapshot: ClusterSnapshot, current: int, cfg: ScalingConfig) -> tuple[int, str]:
    """Replicas to add now (0: none) and why."""
    n = max(current, 1)
    steps: list[tuple[int, str]] = []
    p99 = snapshot.tbt_p99_s
    busy = snapshot.token_load > 0  # an idle cluster's old breach samples are history
    if (busy and p99 is not None and snapshot.num_tbt_samples >= cfg.min_samples
            and p99 > cfg.tbt_slo_s * cfg.upscale_margin):
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


def can_shrink(snapshot: ClusterSnapshot, current: int, cfg: ScalingConfig) -> bool:
    """Would `current - 1` replicas still hold the SLO with `downscale_margin` to spare?"""
    if current <= 1:
        return current == 1 and cfg.min_replicas == 0 and snapshot.token_load == 0
    spread = current / (current - 1)
    idle = snapshot.token_load == 0
    p99 = snapshot.tbt_p99_s
    tbt_ok = idle or (p99 is not None and snapshot.num_tbt_samples >= cfg.min_samples
                      and p99 * spread < cfg.tbt_slo_s * cfg.downscale_margin)
    queue_ok = (cfg.queued_tokens_per_replica is None or
                snapshot.waiting_tokens / (current - 1) < cfg.queued_tokens_per_replica * cfg.downscale_margin)
    load_ok = (cfg.token_load_per_replica is None or
               snapshot.token_load / (current - 1) < cfg.token_load_per_replica * cfg.downscale_margin)
    return tbt_ok and queue_ok and load_ok


def decide_replicas(snapshot: ClusterSnapshot, current: int, state: ScalingState, now: float,
                    cfg: ScalingConfig, target: int | None = None) -> tuple[int, ScalingState]:
    """Desired replica count and the new state; `target` is the count a change is heading to."""
    lo, hi = cfg.min_replicas, cfg.max_replicas
    if target is not None and target != current:
        # A change is settling: hold its target; the cool-downs start once it lands.
        return min(max(target, lo), hi), ScalingState(now, None, "settling")
    if current < lo or current > hi:
        return min(max(current, lo), hi), ScalingState(now, None, "out_of_bounds")
    since_change = math.inf if state.last_change_s is None else now - state.last_change_s

    add, why = upscale_need(snapshot, current, cfg)
    if add:
        if current >= hi:
            return current, replace(state, down_since_s=None, reason=f"{why}:at_max")
        if since_change < cfg.upscale_cooldown_s:
            return current, replace(state, down_since_s=None, reason=f"{why}:cooldown")
        return min(current + add, hi), ScalingState(now, None, why)

    if current > lo and can_shrink(snapshot, current, cfg):
        down_since = state.down_since_s if state.down_since_s is not None else now
        if now - down_since >= cfg.downscale_stable_s and since_change >= cfg.downscale_cooldown_s:
            return current - 1, ScalingState(now, None, "slo_holds_with_fewer")
        return current, ScalingState(state.last_change_s, down_since, "downscale_pending")
    return current, ScalingState(state.last_change_s, None, "hold")
