"""`TbtSloPolicy`: a Ray Serve 2.60 custom autoscaling policy against a TBT SLO.

Serve's controller instantiates the class once with `AutoscalingPolicy.policy_kwargs` (2.60
instantiates a class-valued `policy_function` with those kwargs; a plain function would get
none) and calls it every control-loop tick (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`, 0.1 s) with an
`AutoscalingContext`. It returns `(desired_replicas, policy_state)`; the decision itself is
`scaling.decide_replicas`, and its state rides in Serve's `policy_state` dict.

Input, in order of preference:
1. the controller actor's snapshot over the running replicas, fetched without blocking Serve's
   control loop: a fetch starts at most every `fetch_interval_s` (0.5 s: percentiles over a
   long window are not free) and ticks decide on the latest one that has arrived;
2. else `ctx.aggregated_metrics` from the replicas' `record_autoscaling_stats()` (keys
   `tbt_p99_s`, `tbt_p50_s`, `num_tbt_samples`, `running_tokens`, `waiting_tokens`), pushed every
   `RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S` seconds (default 10: set it to ~0.5 in
   the replicas' environment if this path matters) and averaged over `look_back_period_s`;
3. else hold at Serve's current target.

Serve still wraps the policy: scaling factors, `upscale_delay_s`/`downscale_delay_s` and the
min/max bounds. Our hysteresis and cool-downs live in the decision, so set both delays to 0
(`serve_options.autoscaling_config` does); min/max come from the AutoscalingConfig (one source).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from autoscale.controller import DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE, get_or_create_controller
from autoscale.keys import replica_key
from autoscale.load import ClusterSnapshot
from autoscale.placement import placeable_replicas
from replicas.protocol import ReplicaLoad
from autoscale.scaling import ScalingConfig, ScalingState, decide_replicas

logger = logging.getLogger("ray.serve")  # the Serve controller runs the policy: its log file

STATE_KEY = "tbt_slo"
LOOKUP_RETRY_S = 5.0
MAX_SNAPSHOT_AGE_S = 5.0  # an older snapshot (or a fetch pending longer) is not trusted


def snapshot_from_metrics(metrics: Mapping[str, Mapping[Any, float]] | None) -> ClusterSnapshot | None:
    """A coarse snapshot from Serve's aggregated custom metrics; None when they are absent.

    Per-replica p99s cannot be merged exactly: the worst replica's p99 stands for the cluster
    (conservative: it errs toward scaling up).
    """
    if not metrics or "tbt_p99_s" not in metrics:
        return None
    p99s, p50s = metrics.get("tbt_p99_s", {}), metrics.get("tbt_p50_s", {})
    counts = metrics.get("num_tbt_samples", {})
    replicas = {}
    for rid in set(p99s) | set(metrics.get("running_tokens", {})) | set(metrics.get("waiting_tokens", {})):
        key = replica_key(rid)
        replicas[key] = ReplicaLoad(
            key, running_tokens=int(metrics.get("running_tokens", {}).get(rid, 0)),
            waiting_tokens=int(metrics.get("waiting_tokens", {}).get(rid, 0)))
    return ClusterSnapshot(replicas, max(p50s.values(), default=None), max(p99s.values(), default=None),
                           int(sum(counts.values())))


class TbtSloPolicy:
    """Scale a deployment so windowed p99 TBT stays under the SLO (see module docstring)."""

    def __init__(self, controller_name: str = DEFAULT_CONTROLLER_NAME,
                 namespace: str = DEFAULT_NAMESPACE, fetch_interval_s: float = 0.5,
                 snapshot_source: Any = None, *, tbt_slo_s: float, replica_bundles: list[dict] | None = None,
                 free_resources: Any = None, **scaling: Any) -> None:
        """`tbt_slo_s`: the engine's TBT SLO in seconds; `scaling` are `ScalingConfig` fields,
        min/max aside: those come from Serve's AutoscalingConfig.

        `snapshot_source(replica_ids, window_s, since, tbt_slo_s) -> ClusterSnapshot | None` is
        injectable for tests; by default the controller actor is asked.

        `replica_bundles`: the resources one replica takes (its placement group's bundles, or its
        one actor's); with `within_free_devices`, no upscale goes past what the nodes' free
        resources place (`free_resources() -> [{resource: amount} per node]`, Ray's by default).
        """
        self.replica_bundles = replica_bundles
        self._free_resources = free_resources or _free_resources_per_node
        self.placeable: int | None = None
        self.cfg = ScalingConfig.from_dict(scaling)
        self.tbt_slo_s = tbt_slo_s
        self.controller_name, self.namespace = controller_name, namespace
        self.fetch_interval_s = fetch_interval_s
        self._source = snapshot_source
        self._controller: Any = None
        self._pending: Any = None  # concurrent.futures.Future of the snapshot being fetched
        self._pending_since = -math.inf
        self._latest: ClusterSnapshot | None = None
        self._lookup_after = 0.0
        self.last_reason = "init"

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Serve's entry point: `(desired replicas, policy_state)` from an AutoscalingContext."""
        now = ctx.current_time
        state_dict = dict(ctx.policy_state or {})
        state = ScalingState.from_dict(state_dict.get(STATE_KEY))
        cfg = dataclasses.replace(self.cfg, min_replicas=ctx.capacity_adjusted_min_replicas,
                                  max_replicas=max(ctx.capacity_adjusted_max_replicas,
                                                   ctx.capacity_adjusted_min_replicas, 1))
        ids = [replica_key(r) for r in ctx.running_replicas]
        since = state.window_start(now, cfg.window_s, ctx.target_num_replicas != ctx.current_num_replicas)
        snapshot = self._snapshot(ids, since, now) or snapshot_from_metrics(self._metrics(ctx))
        if snapshot is None:
            self.last_reason = "no_load_data"
            return ctx.target_num_replicas, state_dict
        self.placeable = self._placeable()
        desired, state = decide_replicas(snapshot, ctx.current_num_replicas, state, now, cfg,
                                         self.tbt_slo_s, target=ctx.target_num_replicas, placeable=self.placeable)
        self.last_reason = state.reason
        self._export(ctx.current_num_replicas, desired, snapshot)
        if desired != ctx.target_num_replicas:
            logger.info("tbt_slo policy: %d -> %d replicas (%s; p99=%s, samples=%d, waiting=%d)",
                        ctx.target_num_replicas, desired, state.reason, snapshot.tbt_p99_s,
                        snapshot.num_tbt_samples, snapshot.waiting_tokens)
        state_dict[STATE_KEY] = state.to_dict()
        return desired, state_dict

    def _export(self, current: int, desired: int, snapshot: ClusterSnapshot) -> None:
        """Gauges of the scaling view (Ray metrics; silently off where Ray has none)."""
        if getattr(self, "_gauges", None) is None:
            try:
                from replicas.serving.metric_backends import RayBackend
                from replicas.serving.metrics import PREFIX
                g = RayBackend().gauge
                self._gauges = {k: g(PREFIX + k, doc, ()) for k, doc in (
                    ("current_replicas", "Engine replicas running now."),
                    ("desired_replicas", "Engine replicas the TBT-SLO policy asks for."),
                    ("cluster_tbt_p99_seconds", "p99 TBT over the scaling window, all replicas."),
                    ("cluster_tbt_slo_token_share", "Fraction of TBT samples (gaps) within the SLO (window)."),
                    ("placeable_replicas", "More engine replicas the cluster's free resources can place."))}
            except Exception as exc:  # no Ray metrics here (e.g. a test): export nothing
                logger.info("tbt_slo policy gauges disabled: %r", exc)
                self._gauges = {}
        values = {"current_replicas": current, "desired_replicas": desired,
                  "cluster_tbt_p99_seconds": snapshot.tbt_p99_s, "cluster_tbt_slo_token_share": snapshot.tbt_slo_token_share,
                  "placeable_replicas": self.placeable}
        for key, gauge in self._gauges.items():
            if values[key] is not None:
                try:
                    gauge.record(float(values[key]), {})
                except Exception as exc:  # a gauge must never stop the scaling decision
                    logger.debug("policy gauge %s not recorded: %r", key, exc)

    def _placeable(self) -> int | None:
        """Replicas the nodes' free resources still place (None: unbounded, or unknown)."""
        if not self.cfg.within_free_devices or not self.replica_bundles:
            return None
        try:
            return placeable_replicas(self._free_resources(), self.replica_bundles)
        except Exception as exc:  # noqa: BLE001 - unknown is unbounded: Serve places what it can
            logger.debug("free resources unknown: %r", exc)
            return None

    @staticmethod
    def _metrics(ctx: Any) -> Mapping[str, Mapping[Any, float]] | None:
        return getattr(ctx, "aggregated_metrics", None)  # absent in older Serve contexts

    def _snapshot(self, ids: list[str], since: float, now: float) -> ClusterSnapshot | None:
        """The latest controller snapshot that has arrived; starts the next fetch."""
        if self._source is not None:
            return self._source(ids, self.cfg.window_s, since, self.tbt_slo_s)
        fut = self._pending
        if fut is not None and fut.done():
            self._pending = None
            try:
                self._latest = fut.result()
            except Exception as exc:
                logger.debug("controller snapshot failed: %r", exc)
                self._controller, self._latest = None, None
                self._lookup_after = now + LOOKUP_RETRY_S
        elif fut is not None and now - self._pending_since > MAX_SNAPSHOT_AGE_S:
            self._pending, self._controller = None, None  # hung: look it up again
        if self._pending is None and now - self._pending_since >= self.fetch_interval_s:
            self._pending, self._pending_since = self._fetch(ids, since, now), now
        if self._latest is not None and now - self._latest.timestamp > MAX_SNAPSHOT_AGE_S:
            self._latest = None  # the controller has been silent too long to trust
        return self._latest

    def _fetch(self, ids: list[str], since: float, now: float) -> Any:
        if self._controller is None:
            if now < self._lookup_after:
                return None
            try:
                self._controller = get_or_create_controller(self.controller_name, self.namespace)
            except Exception as exc:
                logger.debug("controller lookup failed: %r", exc)
                self._lookup_after = now + LOOKUP_RETRY_S
                return None
        ref = self._controller.snapshot.remote(ids, self.cfg.window_s, since, self.tbt_slo_s)
        return ref.future()


def _free_resources_per_node() -> list[dict[str, float]]:
    """Each alive node's free resources, from Ray's GCS."""
    from ray._private.state import available_resources_per_node

    return list(available_resources_per_node().values())
