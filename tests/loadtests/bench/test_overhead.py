"""The overhead benchmark drives real decodes and splits each pass into forward and the rest."""

from __future__ import annotations

import pytest

from loadtests.bench.overhead import measure

pytestmark = pytest.mark.engine


def test_measure_splits_the_pass() -> None:
    row = measure("embedded:tiny", decodes=8, steps=3, sampled=True, threads=1, long_prompt=64)
    assert set(row) == {"iteration_ms", "forward_ms", "overhead_ms", "overhead_cpu_ms", "caller_text_ms"}
    assert 0 < row["forward_ms"] < row["iteration_ms"]
    assert row["overhead_ms"] > 0 and row["overhead_cpu_ms"] > 0
    assert row["caller_text_ms"] > 0  # as in a replica, the streams decoded the text, off the loop
