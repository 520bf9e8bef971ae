"""Controller actor, token-load request router, TBT-SLO autoscaling policy."""
