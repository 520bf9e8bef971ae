"""A routed request counts toward its replica until a report newer than its send (plus grace)
arrives or it completes; with no report at all every uncompleted request counts."""

from __future__ import annotations

import pytest

from autoscale.inflight import InFlightBook
from autoscale.load import ReplicaLoad
from autoscale.routing import RequestCost

pytestmark = pytest.mark.unit


def test_tentative_then_routed_elsewhere_then_completed():
    book = InFlightBook(reflect_grace_s=0.05)
    book.tentative("q1", "a", RequestCost(100, 150), now=10.0)
    assert book.unreflected({}) == ({"a": 100}, {"a": 150})
    book.routed("q1", "b", now=10.01)  # a rejected it; b took it; the cost carries over
    assert book.unreflected({}) == ({"b": 100}, {"b": 150})
    book.tentative("q1", "a", RequestCost(1, 1), now=10.02)  # a late re-rank cannot undo a send
    assert book.outstanding() == {"b": 100}
    book.completed("q1")
    assert book.outstanding() == {} and len(book) == 0


def test_a_newer_report_absorbs_the_request():
    book = InFlightBook(reflect_grace_s=0.05)
    book.routed("q1", "a", now=10.0, cost=RequestCost(100, 100))
    book.routed("q2", "a", now=10.2, cost=RequestCost(30, 30))
    before = {"a": ReplicaLoad("a", waiting_tokens=0, timestamp=10.03)}  # within grace: not yet in it
    assert book.unreflected(before)[0] == {"a": 130}
    after = {"a": ReplicaLoad("a", waiting_tokens=100, timestamp=10.1)}  # includes q1, not q2
    assert book.unreflected(after)[0] == {"a": 30}
    assert book.outstanding() == {"a": 130}  # the local view still counts both until completion


def test_tentative_choices_are_never_absorbed_and_expire():
    book = InFlightBook(reflect_grace_s=0.05, tentative_ttl_s=2.0, ttl_s=100.0)
    book.tentative("q1", "a", RequestCost(10, 10), now=0.0)
    book.routed("q2", "b", now=0.0, cost=RequestCost(20, 20))
    assert book.unreflected({"a": ReplicaLoad("a", timestamp=5.0)})[0] == {"a": 10, "b": 20}
    book.prune(now=3.0)
    assert book.outstanding() == {"b": 20}
    book.prune(now=101.0)
    assert book.outstanding() == {}


def test_forget_replica():
    book = InFlightBook()
    book.routed("q1", "a", now=0.0, cost=RequestCost(5, 5))
    book.routed("q2", "b", now=0.0, cost=RequestCost(7, 7))
    book.forget_replica("a")
    assert book.outstanding() == {"b": 7}
