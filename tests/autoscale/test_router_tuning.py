"""The router's knobs are one frozen record, validated once, each error naming its field; an
unknown keyword is refused, and the routing functions take their defaults from it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from autoscale import routing
from autoscale.router_tuning import RANKINGS, RouterTuning

pytestmark = pytest.mark.unit


def test_defaults_are_defined_once_and_the_routing_functions_use_them():
    t = RouterTuning()
    assert (t.ranking, t.sample_size, t.prefix_imbalance) == ("token_load", 16, 0.1)
    for fn in (routing.choose_replica, routing.choose_by_ttft, routing.choose_by_prefix):
        assert inspect.signature(fn).parameters["sample_size"].default == t.sample_size
    assert inspect.signature(routing.choose_by_prefix).parameters["max_imbalance"].default == t.prefix_imbalance
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.sample_size = 2  # type: ignore[misc]


def test_from_kwargs_builds_and_refuses_unknown_keywords():
    t = RouterTuning.from_kwargs({"ranking": "prefix", "sample_size": None, "seed": 7})
    assert (t.ranking, t.sample_size, t.seed) == ("prefix", None, 7)
    with pytest.raises(ValueError, match="sampel_size"):
        RouterTuning.from_kwargs({"sampel_size": 8})


@pytest.mark.parametrize("field,value", [
    ("ranking", "random"), ("sample_size", 1), ("sample_size", 2.5), ("sample_size", True),
    ("prefix_hints", -1), ("default_max_tokens", -5), ("seed", "x"), ("refresh_interval_s", -1), ("snapshot_timeout_s", 0),
    ("stale_after_s", -1.0), ("snapshot_timeout_s", float("nan")), ("max_snapshot_age_s", "2"),
    ("stale_wait_s", -0.1), ("reflect_grace_s", -1), ("prefix_imbalance", -0.5)])
def test_each_bad_value_names_its_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterTuning(**{field: value})


def test_rankings_are_the_routers():
    from autoscale.router import RANKINGS as ROUTER_RANKINGS

    assert set(ROUTER_RANKINGS) == set(RANKINGS)
