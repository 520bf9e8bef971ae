"""The autoscaler in the simulator: `autoscale.scaling.decide_replicas` on a `ClusterSnapshot`.

Every `interval_s` the simulator builds the snapshot the controller would hold (each ready
replica's latest report, the fleet's TBT window, the demand served and refused;
`ClusterSnapshot.build`) and asks the
production decision for a replica count. Serve's part is mimicked here: `current` is the number
of ready replicas, `target` the count being headed to (ready + starting); new replicas become
ready `startup_s` after they are asked for; a replica scaled away stops taking requests, drains
its running ones, and is released when empty (it is billed until then).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from autoscale.demand import DemandLog
from autoscale.load import ClusterSnapshot, LogHistogram, TbtWindow
from autoscale.scaling import ScalingConfig, ScalingState, decide_replicas
from replicas.scheduling.histogram import NUM_BINS


@dataclass
class ScalingTrace:
    """Decisions over time, for plots: (t, ready, provisioned, desired, reason)."""

    points: list[tuple[float, int, int, int, str]] = field(default_factory=list)


class Autoscaler:
    def __init__(self, cfg: ScalingConfig, tbt_slo_s: float, interval_s: float = 1.0,
                 startup_s: float = 60.0) -> None:
        self.cfg = cfg
        self.tbt_slo_s = tbt_slo_s
        self.interval_s = interval_s
        self.startup_s = startup_s
        self.state = ScalingState()
        self.trace = ScalingTrace()

    def decide(self, ready: list, num_starting: int, now: float, demand: DemandLog | None = None,
               window: TbtWindow | None = None) -> tuple[int, str]:
        """Desired replica count from the ready replicas' reports (`SimReplica`s), the fleet's TBT
        `window` and the demand admitted and refused since the last change, as the controller
        reads them."""
        loads = {r.replica_id: r.last_report for r in ready if r.last_report is not None}
        tbt = [0] * NUM_BINS
        if window is not None:
            window.add_window(tbt, now)
        snapshot = ClusterSnapshot.build(loads, LogHistogram.from_dense(tbt), self.tbt_slo_s, now)
        if demand is not None:
            since = self.state.window_start(now, self.cfg.window_s, settling=num_starting > 0)
            served, refused = demand.rates(now, since)
            snapshot = dataclasses.replace(snapshot, served_tps=served, refused_tps=refused)
        target = len(ready) + num_starting
        desired, self.state = decide_replicas(snapshot, len(ready), self.state, now, self.cfg, self.tbt_slo_s,
                                              target=target)
        self.trace.points.append((now, len(ready), target, desired, self.state.reason))
        return desired, self.state.reason
