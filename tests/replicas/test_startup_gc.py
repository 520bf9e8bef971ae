"""A serving process freezes what start-up built, so that full collections walk only what came
after; a process that is not its own (a test's) is left alone."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from replicas.serving import startup_gc

pytestmark = pytest.mark.unit


def test_outside_a_worker_nothing_is_frozen(caplog: pytest.LogCaptureFixture) -> None:
    before, threshold = gc.get_freeze_count(), gc.get_threshold()
    assert not startup_gc.in_worker_process()  # no Ray started here, and none is started by asking
    with caplog.at_level(logging.INFO, "test.gc"):
        assert startup_gc.freeze_startup_objects(logging.getLogger("test.gc"), "the test") == 0
    assert gc.get_freeze_count() == before and gc.get_threshold() == threshold and not caplog.records


def test_a_process_of_its_own_freezes_its_objects_and_later_ones_stay_collectable() -> None:
    # In a child: freezing this test's process would keep its cycles for the rest of the run.
    code = """
import gc, logging, sys
from replicas.serving.startup_gc import freeze_startup_objects

class Cycle:
    def __init__(self):
        self.me = self

startup = [Cycle() for _ in range(1000)]
garbage = Cycle(); del garbage  # start-up's garbage goes before the freeze, not into it
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
frozen = freeze_startup_objects(logging.getLogger("t"), "the child", own_process=True)
tracked = len(gc.get_objects())  # what full collections still walk
later = Cycle(); del later
print(frozen, gc.get_freeze_count(), tracked, gc.collect(), gc.get_threshold()[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2]).stdout
    log_line, numbers = out.strip().splitlines()
    frozen, count, tracked, collected, gen0 = map(int, numbers.split())
    assert "the child:" in log_line and "frozen out of garbage collection" in log_line
    assert frozen == count >= 1000  # the start-up objects at least
    assert tracked < 200  # what a full collection walks: almost nothing left beside the frozen
    assert collected >= 1  # a cycle made after the freeze is still collected
    assert gen0 == startup_gc.GEN0_THRESHOLD


def test_health_reports_the_collector() -> None:
    state = startup_gc.gc_state()
    assert state["frozen"] == gc.get_freeze_count() and state["threshold"] == list(gc.get_threshold())
    assert len(state["collections"]) == 3 and all(isinstance(n, int) for n in state["collections"])
