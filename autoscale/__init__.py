"""Controller actor, token-load request router, TBT-SLO autoscaling policy.

Pure (no Ray, reused by the simulator): `load` (ReplicaLoad, ClusterSnapshot, TbtWindow),
`routing` (choose_replica, power_of_two, round_robin, request_cost), `router_tuning` (RouterTuning),
`prefix_hints` (PrefixHints), `inflight` (InFlightBook),
`scaling` (ScalingConfig, ScalingState, decide_replicas).
Ray / Serve: `controller` (LoadController actor, LoadBook), `reporter` (LoadReporter, inside a
replica), `router` (TokenLoadRouter), `policy` (TbtSloPolicy), `serve_options` (deployment options).
"""
