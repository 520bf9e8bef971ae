"""Replicas in the simulator shed as the real ones do, and a load step they shed grows the fleet
through the refused-demand signal: afterwards it refuses under 1%, where the autoscaler without
the signal (TBT and queue rules alone) keeps refusing."""

from __future__ import annotations

import pytest

from loadtests.sim import shedding

pytestmark = pytest.mark.unit


def test_a_shed_load_step_grows_the_fleet_until_it_refuses_under_one_percent():
    out = shedding.run(per_replica_rps=3.7, step_x=4.0, duration_s=420.0, startup_s=30.0, bin_s=60.0)
    with_signal, without = out["arms"]["demand signal"], out["arms"]["without (before)"]
    step_bin = int(out["step"][2] // 60)
    assert with_signal["refused"][step_bin] > 100 and without["refused"][step_bin] > 100  # it sheds
    assert "refused_demand" in with_signal["reasons"] and "refused_demand" not in without["reasons"]
    assert with_signal["refused_share_after_growth"] < 0.01
    assert without["refused_share_after_growth"] > 2 * with_signal["refused_share_after_growth"]
    assert with_signal["max_replicas"] >= 4  # the step is four replicas' capacity
